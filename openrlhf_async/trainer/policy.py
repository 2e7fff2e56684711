"""The policy: one Ray actor per DeepSpeed rank (ZeRO-3 by default), trained with the DAPO/GRPO loss and an
off-policy correction against the rollout logprobs; optionally a frozen reference model for a KL penalty.

Rank 0 also owns the sender side of the weight-sync group into the vLLM engines."""

import os
import socket

import torch

from openrlhf_async.trainer.losses import policy_loss, token_logprobs
from openrlhf_async.utils.ray_utils import get_all
from openrlhf_async.utils.timeline import Timeline

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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


# Stands in for a micro batch a rank has no samples for; it has no response tokens, so it adds no gradient.
EMPTY_SAMPLE = {"prompt_ids": [0, 0], "response_ids": []}


class PolicyActor:
    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str, *,
                 backend: str, zero_stage: int, dtype: str, lr: float, betas: tuple, weight_decay: float,
                 max_norm: float, seed: int, reference: bool = False):
        # LOCAL_RANK 0: Ray gives each rank actor its own GPU as device 0 (CUDA_VISIBLE_DEVICES).
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        import deepspeed
        from transformers import AutoModelForCausalLM
        from transformers.integrations.deepspeed import HfDeepSpeedConfig

        torch.manual_seed(seed)
        if backend == "gloo":
            make_collectives_synchronous()
        deepspeed.init_distributed(dist_backend=backend)
        self.rank, self.world_size, self.zero_stage = rank, world_size, zero_stage
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": max_norm,
            "zero_optimization": {"stage": zero_stage},
            "bf16": {"enabled": dtype == "bf16"},
            "fp16": {"enabled": dtype == "fp16"},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        # Must exist (and stay referenced) before from_pretrained so transformers partitions weights for ZeRO-3.
        self._hf_ds_config = HfDeepSpeedConfig(ds_config) if zero_stage == 3 else None
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=TORCH_DTYPES[dtype])
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        self.reference = None
        if reference:  # the initial policy, frozen (partitioned like the policy under ZeRO-3)
            ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=TORCH_DTYPES[dtype])
            self.reference, *_ = deepspeed.initialize(model=ref_model.eval().requires_grad_(False), config=ds_config)
        self.model_path = model_path
        self.sync_group = None
        self.timeline = Timeline(f"rank {rank}")

    def take_spans(self) -> list:
        return self.timeline.take()

    def ready(self) -> bool:
        return True

    # ---- training ----------------------------------------------------------------------------------------------

    def _device(self):
        return next(self.engine.module.parameters()).device

    def _batch(self, samples: list):
        """Right-padded input ids, attention mask and a mask of response positions in the shifted targets."""
        length = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
        ids = torch.zeros(len(samples), length, dtype=torch.long)
        attn = torch.zeros(len(samples), length, dtype=torch.long)
        resp = torch.zeros(len(samples), length - 1)
        old = torch.zeros(len(samples), length - 1)
        adv = torch.zeros(len(samples), length - 1)
        for i, s in enumerate(samples):
            p, r = len(s["prompt_ids"]), len(s["response_ids"])
            ids[i, : p + r] = torch.tensor(s["prompt_ids"] + s["response_ids"])
            attn[i, : p + r] = 1
            # Target position t predicts token t+1; tokens the environment wrote (action_mask 0) are not trained.
            resp[i, p - 1 : p + r - 1] = torch.tensor(s.get("action_mask", [1] * r), dtype=torch.float32)
            if "logprobs" in s:
                old[i, p - 1 : p + r - 1] = torch.tensor(s["logprobs"], dtype=torch.float32)
            adv[i, p - 1 : p + r - 1] = s.get("advantage", 0.0)
        dev = self._device()
        return ids.to(dev), attn.to(dev), resp.to(dev), old.to(dev), adv.to(dev)

    def _logprobs(self, ids, attn, temperature: float):
        logits = self.engine(input_ids=ids, attention_mask=attn).logits[:, :-1]
        return token_logprobs(logits, ids[:, 1:], temperature), logits

    def train_step(self, samples: list, global_tokens: int, num_micro_batches: int, loss_cfg: dict) -> dict:
        """One optimizer step over this rank's samples; the loss is a token mean over the global batch.
        Every rank runs the same number of micro batches: ZeRO-3 gathers parameters collectively per forward.
        loss_cfg: eps_low, eps_high, correction, clamp, band, kl_coef, temperature (see losses.policy_loss)."""
        with self.timeline.span("train"):
            return self._train_step(samples, global_tokens, num_micro_batches, loss_cfg)

    def _train_step(self, samples: list, global_tokens: int, num_micro_batches: int, loss_cfg: dict) -> dict:
        self.engine.train()
        totals = dict.fromkeys(["loss", "clipped", "corrected", "weight", "kl"], 0.0)
        tokens = 0
        size = -(-len(samples) // num_micro_batches) if samples else 1
        micro_batches = [samples[k * size : (k + 1) * size] or [EMPTY_SAMPLE] for k in range(num_micro_batches)]
        for k, micro in enumerate(micro_batches):
            ids, attn, mask, behaviour, adv = self._batch(micro)
            ref_logp = None
            if self.reference is not None and loss_cfg["kl_coef"] > 0:
                with torch.no_grad():
                    ref_logits = self.reference(input_ids=ids, attention_mask=attn).logits[:, :-1]
                    ref_logp = token_logprobs(ref_logits, ids[:, 1:], loss_cfg["temperature"])
            logp, _ = self._logprobs(ids, attn, loss_cfg["temperature"])
            # One optimizer step per batch: the proximal policy is the current one (ratio 1, clipping inactive
            # until several updates share a batch); the off-policy gap to vLLM's sampler is the importance weight.
            out = policy_loss(logp, logp.detach(), behaviour, adv, mask, loss_cfg["eps_low"], loss_cfg["eps_high"],
                              loss_cfg["correction"], loss_cfg["clamp"], tuple(loss_cfg["band"]), ref_logp,
                              loss_cfg["kl_coef"])
            # DeepSpeed averages gradients over ranks, so scale the global token mean back up by world size.
            loss = out["loss"] * self.world_size / global_tokens
            self.engine.set_gradient_accumulation_boundary(k == len(micro_batches) - 1)
            self.engine.backward(loss, scale_wrt_gas=False)
            for key in totals:
                totals[key] += float(out[key])
            tokens += int(mask.sum())
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        return {**totals, "tokens": tokens, "grad_norm": float(grad_norm) if grad_norm is not None else 0.0}

    @torch.no_grad()
    def forward_logprobs(self, samples: list, temperature: float = 1.0) -> list:
        """Per-response-token logprobs and greedy (argmax) tokens under the current weights.
        Under ZeRO-3 every rank must call this with the same samples (parameters are gathered collectively)."""
        self.engine.eval()
        ids, attn, mask, _, _ = self._batch(samples)
        logp, logits = self._logprobs(ids, attn, temperature)
        greedy = logits.argmax(-1)
        out = []
        for i in range(len(samples)):
            pos = mask[i].bool()
            out.append({"logprobs": logp[i][pos].tolist(), "greedy_ids": greedy[i][pos].tolist()})
        return out

    # ---- weight sync -------------------------------------------------------------------------------------------

    def weight_sync_address(self) -> tuple:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def named_shapes(self) -> list:
        dtype = str(next(self.engine.module.parameters()).dtype).replace("torch.", "")
        return [(n, dtype, tuple(getattr(p, "ds_shape", p.shape))) for n, p in self.engine.module.named_parameters()]

    def init_weight_sync_group(self, host: str, port: int, world_size: int, backend: str) -> None:
        if self.rank != 0:
            return
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.sync_group = stateless_init_torch_distributed_process_group(host, port, 0, world_size, backend=backend)

    def broadcast_weights(self, buckets: list) -> None:
        """Gather each bucket's parameters (collective over the ZeRO-3 ranks) and broadcast them from rank 0."""
        import deepspeed

        params = dict(self.engine.module.named_parameters())
        with self.timeline.span("sync"):
            for bucket in buckets:
                tensors = [params[name] for name, _, _ in bucket]
                with deepspeed.zero.GatheredParameters(tensors, enabled=self.zero_stage == 3):
                    if self.rank == 0:
                        flat = torch.cat([t.data.reshape(-1) for t in tensors])
                        self.sync_group.broadcast(flat, root=0).wait()

    def read_weight(self, name: str) -> torch.Tensor:
        import deepspeed

        param = dict(self.engine.module.named_parameters())[name]
        with deepspeed.zero.GatheredParameters([param], enabled=self.zero_stage == 3):
            return param.data.detach().float().cpu().clone()

    # ---- resumable checkpoints (trainer/checkpoint.py) ------------------------------------------------------------

    def save_checkpoint(self, path: str) -> None:
        """This rank's DeepSpeed state (its ZeRO shards of weights and optimizer) and torch random state."""
        with self.timeline.span("checkpoint"):
            self.engine.save_checkpoint(path, tag="deepspeed", client_state={"torch_rng": torch.get_rng_state()},
                                        save_latest=False)

    def load_checkpoint(self, path: str) -> None:
        loaded, client_state = self.engine.load_checkpoint(path, tag="deepspeed")
        if loaded is None:
            raise RuntimeError(f"rank {self.rank}: no DeepSpeed state in {path}")
        torch.set_rng_state(client_state["torch_rng"])

    def save_hf(self, path: str) -> None:
        """Save an HF-format checkpoint (config, full weights, tokenizer) from rank 0."""
        import deepspeed
        from transformers import AutoTokenizer

        model = self.engine.module
        state = {}
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], enabled=self.zero_stage == 3):
                if self.rank == 0:
                    state[name] = param.data.detach().cpu().clone()
        if self.rank == 0:
            model.save_pretrained(path, state_dict=state)
            AutoTokenizer.from_pretrained(self.model_path).save_pretrained(path)


class PolicyGroup:
    """The DeepSpeed ranks as Ray actors, with fan-out helpers the trainer loop calls."""

    def __init__(self, cfg, model_path: str):
        import ray

        actor_cls = ray.remote(PolicyActor)
        world = cfg.actor.world_size
        master_addr, master_port = ray.util.get_node_ip_address(), free_port()
        opts = {"num_gpus": 1, "num_cpus": 0} if cfg.device == "cuda" else {"num_cpus": 0}
        env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // world))} if cfg.device == "cpu" else {}
        kwargs = dict(backend=cfg.backend, zero_stage=cfg.ds.zero_stage, dtype=cfg.dtype, lr=cfg.actor.adam_lr,
                      betas=cfg.actor.adam_betas, weight_decay=cfg.actor.adam_weight_decay,
                      max_norm=cfg.actor.max_norm, seed=cfg.train.seed, reference=cfg.algo.kl_coef > 0)
        self.actors = [
            actor_cls.options(**opts, runtime_env={"env_vars": env}).remote(
                rank, world, master_addr, master_port, model_path, **kwargs)
            for rank in range(world)
        ]
        get_all([a.ready.remote() for a in self.actors])

    def shard(self, samples: list) -> list:
        return [samples[r :: len(self.actors)] for r in range(len(self.actors))]

    def call(self, method: str, *args, **kwargs) -> list:
        """Start the same method on every rank; returns the object refs."""
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def train_step(self, samples: list, micro_batch_size: int, loss_cfg: dict) -> dict:
        global_tokens = max(1, sum(sum(s.get("action_mask", [1] * len(s["response_ids"]))) for s in samples))
        shards = self.shard(samples)
        num_micro = max(1, -(-max(len(s) for s in shards) // micro_batch_size))
        results = get_all([
            a.train_step.remote(shard, global_tokens, num_micro, loss_cfg) for a, shard in zip(self.actors, shards)
        ])
        total = {key: sum(r[key] for r in results) for key in ("loss", "clipped", "corrected", "weight", "kl")}
        return {
            "loss": total["loss"] / global_tokens,
            "clip_ratio": total["clipped"] / global_tokens,
            "is_weight_mean": total["weight"] / global_tokens,
            "is_corrected_ratio": total["corrected"] / global_tokens,
            "kl": total["kl"] / global_tokens,
            "grad_norm": results[0]["grad_norm"],
            "tokens": sum(r["tokens"] for r in results),
        }


def loss_settings(cfg, **overrides) -> dict:
    """The loss settings PolicyGroup.train_step takes, from the run's config."""
    settings = {"eps_low": cfg.actor.eps_clip, "eps_high": cfg.actor.eps_clip_high,
                "correction": cfg.algo.off_policy_correction, "clamp": cfg.algo.tis_clamp,
                "band": tuple(cfg.algo.icepop_band), "kl_coef": cfg.algo.kl_coef,
                "temperature": cfg.rollout.temperature}
    settings.update(overrides)
    return settings
