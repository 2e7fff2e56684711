"""A DeepSpeed rank: one Ray actor per rank (any ZeRO stage, 2 by default as in OpenRLHF) holding a model in a
DeepSpeed engine with its optimizer and learning-rate schedule. The policy's ranks (policy.py) and the critic's
(critic.py) are both this, around different models and losses: distributed start-up, the DeepSpeed configs, the
optimizer step, the hybrid engine's offload and reload of the training states, and resumable checkpoints."""

import math
import os

import torch

from openrlhf_async.trainer.batching import sample_length
from openrlhf_async.trainer.sequence_parallel import SequenceGroup
from openrlhf_async.trainer.sequence_parallel import register as register_attention
from openrlhf_async.utils.timeline import Timeline

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Stands in for a micro batch a rank has no samples for; it has no response tokens, so it adds no gradient.
EMPTY_SAMPLE = {"prompt_ids": [0, 0], "response_ids": []}


class _CompletedWork:
    """What a synchronous collective hands back where the caller asked for an asynchronous one."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(None)
        return future


def make_collectives_synchronous() -> None:
    """Run every torch.distributed collective to completion before it returns, even when asked for async_op.

    DeepSpeed's ZeRO-3 launches several asynchronous collectives and waits on the last one only, relying on NCCL
    running them in order on one stream. Gloo runs them on a pool of threads, so buffers were read before they were
    filled: gradients differed from run to run and were sometimes 1e26 or NaN. On CPU ranks nothing overlaps anyway.
    Must run before deepspeed.init_distributed, which keeps references to some of these functions."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
             "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "all_reduce_coalesced",
             "all_to_all_single")
    for name in names:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "_made_synchronous", False):
            continue

        def synchronous(*args, _original=original, async_op=False, **kwargs):
            if async_op and any(c10d._world.pg_coalesce_state.values()):
                return _original(*args, async_op=True, **kwargs)  # inside a coalescing manager: it waits at exit
            work = _original(*args, async_op=False, **kwargs)
            return _CompletedWork() if async_op else work

        synchronous._made_synchronous = True
        setattr(c10d, name, synchronous)
        setattr(dist, name, synchronous)


def deepspeed_config(ds: dict, max_norm: float) -> dict:
    """The DeepSpeed config of a trained model from the --ds.* settings."""
    zero = {"stage": ds["zero_stage"], "overlap_comm": ds["overlap_comm"]}
    if ds["zpg"] > 1:
        zero["zero_hpz_partition_size"] = ds["zpg"]
    if ds["adam_offload"]:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config = {**_engine_settings(ds), "gradient_clipping": max_norm, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True}
    if ds["grad_accum_dtype"]:
        config["data_types"] = {"grad_accum_dtype": ds["grad_accum_dtype"]}
    return config


def frozen_model_config(ds: dict) -> dict:
    """The DeepSpeed config of a frozen model (the reference model) from the same --ds.* settings, as OpenRLHF's
    get_eval_ds_config: ZeRO-3 where the policy is ZeRO-3 (parameters partitioned alike), else stage 0 (stages 1 and 2
    partition only optimizer state and gradients, which a frozen model has none of, and DeepSpeed refuses them
    without an optimizer); the policy's dtype; with --ref.offload its ZeRO-3 partitions in CPU memory."""
    stage = 3 if ds["zero_stage"] == 3 else 0
    zero = {"stage": stage}
    if stage == 3 and ds["ref_offload"]:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {**_engine_settings(ds), "zero_optimization": zero}


def _engine_settings(ds: dict) -> dict:
    """What every DeepSpeed engine here has: one sample per micro batch (the trainer plans its own micro batches and
    accumulation), the policy's dtype, no periodic prints."""
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": ds["dtype"] == "bf16"}, "fp16": {"enabled": ds["dtype"] == "fp16"},
            "steps_per_print": 10**9}


def jit_arch_list() -> None:
    """Before DeepSpeed builds an op (FusedAdam, CPU Adam) on first use: its JIT builder reads TORCH_CUDA_ARCH_LIST
    as numbers and dies on the architecture-specific forms PyTorch itself accepts ("9.0a", set by CUDA images for
    Hopper: "invalid literal for int() with base 10: '0a'", seen on an H200). Such entries are written as their plain
    capability for this process; the ops need no architecture-specific instructions."""
    import re

    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    entries = arch.replace(" ", ";").split(";")
    plain = [re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", e) for e in entries if e.strip()]
    if plain != [e for e in entries if e.strip()]:
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(dict.fromkeys(plain))
        print(f"TORCH_CUDA_ARCH_LIST {arch!r} read as {os.environ['TORCH_CUDA_ARCH_LIST']!r} for DeepSpeed's op "
              "builder", flush=True)


def _init_distributed(backend: str) -> None:
    import deepspeed

    if backend == "gloo":
        make_collectives_synchronous()
        skip_shared_memory_op()
    deepspeed.init_distributed(dist_backend=backend)


def skip_shared_memory_op() -> None:
    """DeepSpeed compiles a shared-memory all-reduce at every CPU start, for inference only (training never uses it):
    about 25 s of a C++ build on 2 cores at a user's first run, and a build killed midway leaves torch's lock file
    behind, on which every later start waits for ever. Set by module name: `deepspeed.comm.torch` read as an attribute
    is PyTorch itself (deepspeed.comm imports torch)."""
    import importlib

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def build_optimizer(trainable: list, optim: dict, ds: dict, device: str):
    """The optimizer (AdamW) of the trainable parameters: DeepSpeed's CPU Adam under ZeRO-Offload, its FusedAdam for
    the hybrid engine's ZeRO-3 on cuda, else torch's."""
    adam = dict(lr=optim["lr"], betas=tuple(optim["betas"]), eps=optim["eps"], weight_decay=optim["weight_decay"])
    if ds["adam_offload"] or (ds.get("enable_sleep") and device == "cuda"):
        jit_arch_list()
    if ds["adam_offload"]:  # ZeRO-Offload steps the optimizer on the CPU: DeepSpeed's own CPU Adam (AdamW)
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(trainable, adamw_mode=True, **adam)
    if ds.get("enable_sleep") and ds["zero_stage"] == 3 and device == "cuda":
        # DeepSpeed offloads ZeRO-3 optimizer states of its FusedAdam only (stage3.offload_states), as OpenRLHF
        # builds it for the hybrid engine.
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(trainable, adam_w_mode=True, **adam)
    return torch.optim.AdamW(trainable, **adam)


def build_scheduler(optim: dict, optimizer):
    """The learning-rate schedule over optim["total_steps"] optimizer steps (transformers' get_scheduler)."""
    from transformers import get_scheduler

    total = max(1, optim["total_steps"])
    extra = {"min_lr_rate": optim["min_lr_ratio"]} if optim["scheduler"] == "cosine_with_min_lr" else {}
    return get_scheduler(optim["scheduler"], optimizer, num_warmup_steps=math.ceil(optim["warmup_ratio"] * total),
                         num_training_steps=total, scheduler_specific_kwargs=extra)


class DeepSpeedRank:
    """A rank's DeepSpeed engine around the model _build makes; the roles (policy.py, critic.py) add their model, their
    loss and their remote methods."""

    role = "rank"  # the actor's name in the run's timeline: "<role> <rank>"

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path, *,
                 backend: str, ds: dict, optim: dict, model: dict, seed: int):
        """model_path: the model's folder (or hub id), or a transformers config for random weights of its shape;
        ds: deepspeed_config's settings; optim: lr, betas, eps, weight_decay, max_norm, scheduler, warmup_ratio,
        min_lr_ratio, total_steps; model: attn_implementation, experts_implementation, gradient_checkpointing,
        reentrant, deterministic (trainer/ranks.py builds them from the config)."""
        # LOCAL_RANK 0: Ray gives each rank actor its own GPU as device 0 (CUDA_VISIBLE_DEVICES).
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        import deepspeed
        from transformers import enable_full_determinism
        from transformers.integrations.deepspeed import HfDeepSpeedConfig

        from openrlhf_async.config import attn_implementation

        torch.manual_seed(seed)
        if model["deterministic"]:
            enable_full_determinism(seed)
        _init_distributed(backend)
        self.rank, self.world_size, self.zero_stage = rank, world_size, ds["zero_stage"]
        self.model_path = model_path
        ds_config = deepspeed_config(ds, optim["max_norm"])
        # Must exist (and stay referenced) before from_pretrained so transformers partitions weights for ZeRO-3.
        self._hf_ds_config = HfDeepSpeedConfig(ds_config) if self.zero_stage == 3 else None
        # from_pretrained's settings, kept for other models of the same rank (the policy's reference)
        self.load = {"dtype": TORCH_DTYPES[ds["dtype"]],
                     "attn_implementation": attn_implementation(model["attn_implementation"], model["device"])}
        if model["experts_implementation"]:
            self.load["experts_implementation"] = model["experts_implementation"]
        # --ds.ring_attn_size: groups of consecutive ranks share each packed row (sequence_parallel.py)
        self.sequence = None
        if ds.get("ring_attn_size", 1) > 1:
            self.sequence = SequenceGroup(rank, world_size, ds["ring_attn_size"])
            self.load["attn_implementation"] = register_attention(self.load["attn_implementation"])
        self.lora = bool(ds.get("lora"))  # only the adapter trains; the frozen base stays out of checkpoints
        module = self._build(model_path, self.load, model, ds)
        optimizer = build_optimizer([p for p in module.parameters() if p.requires_grad], optim, ds, model["device"])
        self.engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer,
                                               lr_scheduler=build_scheduler(optim, optimizer), config=ds_config)
        self.adam_offload, self.offloaded = ds["adam_offload"], False
        self.timeline = Timeline(f"{self.role} {rank}")

    def _build(self, model_path, load: dict, model: dict, ds: dict):
        """The trained model, before DeepSpeed wraps it."""
        raise NotImplementedError

    def take_spans(self) -> list:
        return self.timeline.take()

    def ready(self) -> bool:
        return True

    # ---- training ----------------------------------------------------------------------------------------------

    def _device(self):
        return next(self.engine.module.parameters()).device

    def _targets(self, samples: list) -> dict:
        """One right-padded row per sample over its target positions (position t predicts token t + 1): the mask of
        the response tokens the model wrote, the rollout log-probs, the advantages, and where the samples have
        them the proximal policy's ("old_logprobs") and the reference model's ("ref_logprobs") log-probs, and the
        critic's values and returns ("values", "returns")."""
        width = max(sample_length(s) for s in samples) - 1
        rows = {key: torch.zeros(len(samples), width) for key in ("mask", "logprobs", "advantage")}
        per_token = ("old_logprobs", "ref_logprobs", "values", "returns")
        for key in per_token:
            rows[key] = torch.zeros(len(samples), width) if any(key in s for s in samples) else None
        for i, s in enumerate(samples):
            p, r = len(s["prompt_ids"]), len(s["response_ids"])
            # Tokens the environment wrote (action_mask 0) are not trained.
            rows["mask"][i, p - 1 : p + r - 1] = torch.tensor(s.get("action_mask", [1] * r), dtype=torch.float32)
            # One advantage per sample, or (gae) one per response token.
            advantage = s.get("advantage", 0.0)
            rows["advantage"][i, p - 1 : p + r - 1] = (torch.tensor(advantage, dtype=torch.float32)
                                                       if isinstance(advantage, list) else advantage)
            for key in ("logprobs", *per_token):
                if rows[key] is not None and key in s:
                    rows[key][i, p - 1 : p + r - 1] = torch.tensor(s[key], dtype=torch.float32)
        dev = self._device()
        return {key: None if t is None else t.to(dev) for key, t in rows.items()}

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate a micro batch's gradients (last: the step's last micro batch)."""
        self.engine.set_gradient_accumulation_boundary(last)
        # DeepSpeed averages gradients over ranks, so scale the global mean back up by world size.
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def _optimizer_step(self) -> tuple:
        """Step on the accumulated gradients: (the learning rate the step used, the gradient norm)."""
        self.engine.set_gradient_accumulation_boundary(True)
        lr = self.engine.get_lr()[0]  # the rate this step uses (step() moves the schedule on)
        # At ZeRO stage 0 with fp32 weights DeepSpeed clips the plain optimizer's gradients without keeping their
        # norm: it is measured here, on the gradients each rank holds averaged over all ranks.
        plain_norm = self._grad_norm() if self.zero_stage == 0 else None
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        grad_norm = plain_norm if grad_norm is None else grad_norm
        return lr, float(grad_norm) if grad_norm is not None else 0.0

    @torch.no_grad()
    def _grad_norm(self):
        norms = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.stack(norms).norm()) if norms else None

    # ---- the hybrid engine (trainer/hybrid.py) -------------------------------------------------------------------

    def _offload_include(self) -> list:
        """The DeepSpeed states moved off the device while the engines generate: OpenRLHF's set (the fp32 master
        weights, optimizer moments, gradients) but never the bf16 partitions, which the weight transfer gathers.
        ZeRO-3 moves optimizer states of FusedAdam only (a cuda optimizer): elsewhere its gradients alone."""
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

        if self.zero_stage == 3 and type(self.engine.optimizer.optimizer).__name__ != "FusedAdam":
            return [S.lp_grads, S.contiguous_grad_buffer]
        return [S.optim_states, S.contiguous_grad_buffer, S.hp_params, S.lp_grads]

    def offload_states(self) -> bool:
        """Move the training states to host memory for the engines' turn (on cpu: within host memory, the same calls);
        False when there is nothing to move (ZeRO-Offload keeps them there already, or they are offloaded)."""
        if self.adam_offload or self.offloaded:
            return False
        with self.timeline.span("offload"):
            self.engine.offload_states(include=self._offload_include())
            self.offloaded = True
        return True

    def reload_states(self) -> bool:
        if not self.offloaded:
            return False
        with self.timeline.span("reload"):
            self.engine.reload_states()
            self.offloaded = False
        return True

    # ---- resumable checkpoints (trainer/checkpoint.py) ------------------------------------------------------------

    def save_checkpoint(self, path: str) -> None:
        """This rank's DeepSpeed state (its ZeRO shards of weights and optimizer) and torch random state."""
        with self.timeline.span("checkpoint"):
            # With LoRA the frozen base is left out: it comes from the model's files at every start.
            self.engine.save_checkpoint(path, tag="deepspeed", client_state={"torch_rng": torch.get_rng_state()},
                                        save_latest=False, exclude_frozen_parameters=self.lora)

    def load_checkpoint(self, path: str) -> None:
        loaded, client_state = self.engine.load_checkpoint(path, tag="deepspeed", load_module_strict=not self.lora)
        if loaded is None:
            raise RuntimeError(f"rank {self.rank}: no DeepSpeed state in {path}")
        torch.set_rng_state(client_state["torch_rng"])
