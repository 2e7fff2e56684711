"""`make gpu-check`: the real trainer's ZeRO-3 training step (trainer/policy.py's PolicyActor.train_step, without
Ray) on one GPU, NCCL, bf16, gradient checkpointing, for randomly initialised models of Qwen2.5-1.5B's and
Qwen2.5-7B's shapes; `--device cpu --shape tiny` runs the same code on gloo in fp32 (tests/test_gpu_check.py).

Per shape, in a process of its own (so each peak is its own): a warm-up step, then the same samples as packed rows
(--ds.packing_samples) and as padded rows, at learning rate 0 so that both steps see the same weights. The gradients
the two layouts reach are compared when DeepSpeed steps the optimizer (its grad norm and a few parameters' full
gradients). Peak memory is torch.cuda.max_memory_allocated on a GPU (and max_memory_reserved, what the allocator
held), the peak resident size on CPU.

deepspeed, transformers and accelerate, where missing, are installed from the wheels in --wheels (which
`make gpu-wheels` fills on a machine with a network: --download_wheels). Prints one final JSON line; exits 1 where a
shape's gradients differ or its step failed (out of memory included), 2 where the packages are missing."""

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Published config.json values (Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-1.5B, Qwen/Qwen2.5-7B); "tiny" is the CPU stand-in
# (head_dim 64). benchmarks/gpu_e2e.py builds its models from the same table.
SHAPES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=256, vocab_size=512, rope_theta=10000.0, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, rope_theta=1000000.0, tie_word_embeddings=False),
}
COMMON = dict(rms_norm_eps=1e-6, hidden_act="silu")
# The workload per device: samples, longest prompt, longest response, samples per micro batch.
WORKLOADS = {"cuda": dict(samples=8, prompt_len=512, response_len=1536, micro_batch_size=4),
             "cpu": dict(samples=6, prompt_len=24, response_len=40, micro_batch_size=3)}
# Packed and padded gradients agree to rounding: fp32 closely, bf16 (weights and activations) loosely.
TOLERANCE = {"fp32": dict(norm=1e-4, cosine=0.99999), "bf16": dict(norm=3e-2, cosine=0.99)}
REQUIRED = ("deepspeed", "transformers", "accelerate")  # transformers' DeepSpeed integration needs accelerate
# Left out of --download_wheels: the target has its own torch (a CUDA build) and what torch needs.
NOT_DOWNLOADED = {"torch", "triton", "filelock", "typing-extensions", "sympy", "mpmath", "networkx", "jinja2",
                  "markupsafe", "fsspec", "setuptools"}


def missing_packages(required=None) -> list:
    return [name for name in required or REQUIRED if importlib.util.find_spec(name) is None]


def ensure_packages(wheels: str, required=None, tool: str = "gpu-check", fill: str = "make gpu-wheels") -> bool:
    """The required packages (default: deepspeed, transformers and accelerate) importable: from the folder that
    `make gpu-e2e`'s kit unpacked (benchmarks/gpu_kit.py stage), put first on the path, or installed where missing
    from a folder of wheels (no index, nothing byte-compiled ahead: the machine's time is short)."""
    if wheels and os.path.isfile(os.path.join(wheels, ".kit-sha256")):
        sys.path.insert(0, wheels)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [wheels, os.environ.get("PYTHONPATH")]))
    missing = missing_packages(required)
    if not missing:
        return True
    if not (wheels and os.path.isdir(wheels) and os.listdir(wheels)):
        print(f"{tool}: {' and '.join(missing)} missing and no wheels in {wheels or '--wheels'}: run `{fill}` where "
              f"there is a network and bring {wheels or 'the folder'} along (or pip install them)", flush=True)
        return False
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-compile", "--no-index", "--find-links", wheels,
           *missing]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or missing_packages(required):
        last = (proc.stderr.strip().splitlines() or ["no error message"])[-1]
        print(f"{tool}: could not install {' and '.join(missing)} from {wheels} ({last})", flush=True)
        return False
    return True


def download_wheels(folder: str, python_version: str = "") -> None:
    """Wheels of deepspeed, transformers, accelerate and what they need at the versions installed here, less torch
    and its own requirements. deepspeed publishes only a source archive: it is built here into a pure-Python wheel
    (its CUDA ops compile on first use), so that the GPU machine needs no build tools for it."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins, todo = {}, list(REQUIRED)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in pins or name in NOT_DOWNLOADED:
            continue
        dist = distribution(name)
        pins[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    os.makedirs(folder, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", folder,
                    f"deepspeed=={pins.pop('deepspeed')}"], check=True)
    target = ["--python-version", python_version] if python_version else []
    subprocess.run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", *target, "-d", folder,
                    *(f"{n}=={v}" for n, v in sorted(pins.items()))], check=True)
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    print(f"gpu-wheels: {len(os.listdir(folder))} wheels, {size / 2**20:.1f} MiB in {folder}", flush=True)


def make_samples(count: int, prompt_len: int, response_len: int, vocab: int, seed: int) -> list:
    """Random token ids, lengths between a quarter of the longest and the longest, advantages of either sign."""
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        p, r = rng.randint(max(2, prompt_len // 4), prompt_len), rng.randint(max(1, response_len // 4), response_len)
        samples.append({"prompt_ids": [rng.randrange(vocab) for _ in range(p)],
                        "response_ids": [rng.randrange(vocab) for _ in range(r)],
                        "logprobs": [-rng.uniform(0.5, 3.0) for _ in range(r)],
                        "advantage": rng.choice((1.0, -1.0)) * rng.uniform(0.5, 1.5)})
    return samples


def planned_gb(config, cfg, micro_batch_tokens: int) -> float:
    """The memory plan's estimate (trainer/memory_plan.py, what --dry_run prints) of this step's peak, in GB of 2^30
    bytes, for the micro batch the check runs."""
    from dataclasses import replace

    from openrlhf_async.trainer import memory_plan

    setup = replace(memory_plan.setup_of(cfg), ranks=1, train_tokens=micro_batch_tokens,
                    logprob_tokens=micro_batch_tokens)
    shape = memory_plan.ModelShape.from_config(config.to_dict())
    return round(memory_plan.rank_bytes(shape, setup)["total"] / memory_plan.GB, 3)


class PeakMemory:
    """The process's peak memory in GB: the CUDA allocator's on a GPU, the resident set's (VmHWM) on CPU."""

    def __init__(self, device: str):
        import torch

        self.cuda = device == "cuda"
        self.torch = torch

    def gb(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.torch.cuda.max_memory_allocated() / 2**30
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024 / 2**30


def check_shape(shape_name: str, device: str, dtype: str, workload: dict, seed: int, sleep: bool = False) -> dict:
    """One shape's warm-up, packed and padded steps through PolicyActor.train_step; its figures. With sleep, the
    hybrid engine's trainer side as well: its optimizer (FusedAdam on a GPU, built by DeepSpeed's JIT), the states
    moved to host memory and back (PolicyActor.offload_states / reload_states), then one more padded step that must
    reach the same gradients."""
    import torch
    from deepspeed.utils import safe_get_full_grad
    from transformers import Qwen2Config

    from openrlhf_async.config import parse_config
    from openrlhf_async.trainer.batching import plan, sample_length
    from openrlhf_async.trainer.policy import PolicyActor
    from openrlhf_async.trainer.ranks import (batch_totals, batching_settings, ds_settings, loss_settings,
                                              model_settings, optimizer_settings)
    from openrlhf_async.utils.ports import free_port

    # The trainer's settings from its flags (OpenRLHF's defaults otherwise): ZeRO-3, gradient checkpointing, learning
    # rate 0 (both layouts step from the same weights), no reference model.
    flags = ["--device", device, "--ds.zero_stage", "3", "--ds.param_dtype", dtype,
             "--actor.gradient_checkpointing_enable", "--actor.adam.lr", "0", "--actor.lr_scheduler", "constant",
             "--algo.kl.init_coef", "0", "--train.micro_batch_size", str(workload["micro_batch_size"])]
    cfg = parse_config(flags)
    ds, model = {**ds_settings(cfg), "enable_sleep": sleep}, model_settings(cfg)
    shape = {**COMMON, **SHAPES[shape_name]}
    config = Qwen2Config(**shape)
    peak = PeakMemory(device)
    if device == "cuda":
        torch.cuda.set_device(0)
    actor = PolicyActor(0, 1, "127.0.0.1", free_port(), config, backend="nccl" if device == "cuda" else "gloo",
                        ds=ds, optim=optimizer_settings(cfg), model=model, seed=seed)
    loss_cfg = loss_settings(cfg)
    samples = make_samples(workload["samples"], workload["prompt_len"], workload["response_len"],
                           config.vocab_size, seed)
    # A few small parameters' full gradients beside DeepSpeed's norm over all of them: gathering the embedding's
    # (2 GB in fp32 at 7B) would raise the peak being measured.
    layers = actor.engine.module.model.layers
    watched = {"layers.0.q_proj": layers[0].self_attn.q_proj.weight,
               "layers.0.k_proj": layers[0].self_attn.k_proj.weight,
               "layers.-1.o_proj": layers[-1].self_attn.o_proj.weight,
               "norm": actor.engine.module.model.norm.weight}

    def step(packed: bool) -> dict:
        """A train step as PolicyGroup.train_step gives it to a rank; the watched gradients as DeepSpeed steps."""
        layout = {**batching_settings(cfg), "packing": packed}
        micro = [[samples[i] for i in batch] for batch in
                 plan(samples, 1, workload["micro_batch_size"], layout["max_tokens"], packed)[0]]
        grads, engine_step = {}, actor.engine.step

        def step_and_keep_grads(*args, **kwargs):
            grads.update({name: safe_get_full_grad(p).float().cpu() for name, p in watched.items()})
            return engine_step(*args, **kwargs)

        actor.engine.step = step_and_keep_grads
        try:
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            stats = actor.train_step(micro, batch_totals(samples), loss_cfg, layout)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        finally:
            del actor.engine.step
        return {**stats, "seconds": seconds, "grads": grads}

    step(packed=False)  # warm-up: the optimizer's state is allocated and kernels chosen on the first step
    packed, padded = step(packed=True), step(packed=False)
    cosines = {name: float(torch.nn.functional.cosine_similarity(packed["grads"][name].flatten(),
                                                                 padded["grads"][name].flatten(), dim=0))
               for name in watched}
    slept = sleep_and_wake(actor, step, padded, device, TOLERANCE[dtype]) if sleep else {}
    norm_diff = abs(packed["grad_norm"] - padded["grad_norm"]) / max(padded["grad_norm"], 1e-12)
    tol = TOLERANCE[dtype]
    micro_tokens = max(sum(sample_length(samples[i]) for i in b)
                       for b in plan(samples, 1, workload["micro_batch_size"], None, True)[0])
    return {
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "params": sum(getattr(p, "ds_numel", p.numel()) for p in actor.engine.module.parameters()),
        "peak_gb": round(peak.gb(), 3), "peak_of": "cuda allocator" if device == "cuda" else "process resident set",
        "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 2**30, 3) if device == "cuda" else None,
        "planned_gb": planned_gb(config, cfg, micro_tokens),
        "step_s_packed": round(packed["seconds"], 3), "step_s_padded": round(padded["seconds"], 3),
        "tokens": sum(sample_length(s) for s in samples), "samples": len(samples),
        "micro_batch_size": workload["micro_batch_size"],
        "grad_norm_packed": packed["grad_norm"], "grad_norm_padded": padded["grad_norm"],
        "grad_norm_rel_diff": norm_diff, "min_grad_cosine": min(cosines.values()),
        "grads_match": bool(packed["grad_norm"] > 0 and norm_diff <= tol["norm"]
                            and min(cosines.values()) >= tol["cosine"]),
        "loss_packed": packed["loss"], "loss_padded": padded["loss"],
        "attn_implementation": actor.engine.module.config._attn_implementation,
        "optimizer": type(actor.engine.optimizer.optimizer).__name__, **slept,
    }


def sleep_and_wake(actor, step, padded: dict, device: str, tol: dict) -> dict:
    """The hybrid engine's offload of the training states and their reload, timed, with the device memory each frees
    (on a GPU), and a padded step afterwards whose gradients must equal the padded step's before (to the layouts'
    tolerance: a GPU's backward kernels need not sum in the same order twice)."""
    import torch

    def allocated() -> float:
        if device != "cuda":
            return 0.0
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() / 2**30

    before, offload_s, reload_s = allocated(), [], []
    for _ in range(2):  # the first offload allocates the host buffers: a hybrid run's later steps reuse them
        start = time.perf_counter()
        actor.offload_states()
        offload_s.append(round(time.perf_counter() - start, 3))
        asleep = allocated()
        start = time.perf_counter()
        actor.reload_states()
        reload_s.append(round(time.perf_counter() - start, 3))
    again = step(packed=False)
    cosine = min(float(torch.nn.functional.cosine_similarity(again["grads"][n].flatten(), padded["grads"][n].flatten(),
                                                             dim=0)) for n in padded["grads"])
    norm_diff = abs(again["grad_norm"] - padded["grad_norm"]) / max(padded["grad_norm"], 1e-12)
    return {"offload_s": offload_s, "reload_s": reload_s,
            "offload_freed_gb": round(before - asleep, 3), "awake_gb": round(before, 3),
            "after_wake_grad_norm_rel_diff": norm_diff, "after_wake_min_grad_cosine": cosine,
            "wake_matches": bool(norm_diff <= tol["norm"] and cosine >= tol["cosine"])}


def run_shape(shape: str, args) -> dict:
    """check_shape in a process of its own; an error (out of memory included) as {"error": its last line}."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one_shape", shape, "--device", args.device,
           "--dtype", args.dtype, "--seed", str(args.seed), *(["--sleep"] if args.sleep else [])]
    for key in WORKLOADS["cpu"]:
        if getattr(args, key) is not None:
            cmd += [f"--{key}", str(getattr(args, key))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines and lines[-1].startswith("{"):
        return json.loads(lines[-1])
    errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line]
    sys.stderr.write(proc.stderr[-4000:])
    return {"error": (errors or proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda where torch sees one")
    ap.add_argument("--shape", default=None, help=f"comma-separated, of {', '.join(SHAPES)} (default: 1.5b,7b on "
                                                  "cuda, tiny on cpu)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on cuda, fp32 on cpu")
    for key, value in WORKLOADS["cuda"].items():
        ap.add_argument(f"--{key}", type=int, default=None, help=f"default: {value} on cuda, "
                                                                 f"{WORKLOADS['cpu'][key]} on cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sleep", action="store_true", help="also the hybrid engine's offload of the training states "
                                                         "and their reload, then a step that must match")
    ap.add_argument("--wheels", default="", help="folder of wheels to install missing deepspeed, transformers and "
                                                 "accelerate from")
    ap.add_argument("--download_wheels", metavar="FOLDER", help="fill FOLDER with those wheels and exit")
    ap.add_argument("--python_version", default="", help="with --download_wheels: the GPU machine's Python (3.12)")
    ap.add_argument("--one_shape", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.download_wheels:
        download_wheels(args.download_wheels, args.python_version)
        return 0
    if not ensure_packages(args.wheels):
        return 2
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    workload = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in WORKLOADS[args.device].items()}
    if args.one_shape:
        result = check_shape(args.one_shape, args.device, args.dtype, workload, args.seed, args.sleep)
        print(json.dumps(result), flush=True)
        return 0
    shapes = (args.shape or ("1.5b,7b" if args.device == "cuda" else "tiny")).split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"--shape {','.join(unknown)}: use {', '.join(SHAPES)}")
    results = {}
    for shape in shapes:
        results[shape] = run_shape(shape, args)
        print(f"gpu-check {shape}: {json.dumps(results[shape])}", file=sys.stderr, flush=True)
    gpu = next((r["gpu"] for r in results.values() if r.get("gpu")), None)
    print(json.dumps({"gpu": gpu, "device": args.device, "dtype": args.dtype, "zero_stage": 3, "world_size": 1,
                      "gradient_checkpointing": True, "shapes": results}), flush=True)
    return 0 if all(r.get("grads_match") and r.get("wake_matches", True) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
