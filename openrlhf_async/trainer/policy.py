"""The policy: one Ray actor per DeepSpeed rank (ZeRO-3 by default), trained with the DAPO/GRPO loss and an
off-policy correction against the rollout logprobs; optionally a frozen reference model for a KL penalty.

Rank 0 also owns the sender side of the weight-sync group into the vLLM engines."""

import math
import os
import socket

import torch

from openrlhf_async.trainer.losses import (
    aggregate,
    approx_kl,
    kl_reward_advantages,
    policy_loss,
    token_entropy,
    token_logprobs,
)
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


def deepspeed_config(ds: dict, max_norm: float) -> dict:
    """The DeepSpeed config of the policy (and of its reference model) from the --ds.* settings."""
    zero = {"stage": ds["zero_stage"], "overlap_comm": ds["overlap_comm"]}
    if ds["zpg"] > 1:
        zero["zero_hpz_partition_size"] = ds["zpg"]
    if ds["adam_offload"]:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": max_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": ds["dtype"] == "bf16"},
        "fp16": {"enabled": ds["dtype"] == "fp16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if ds["grad_accum_dtype"]:
        config["data_types"] = {"grad_accum_dtype": ds["grad_accum_dtype"]}
    return config


class PolicyActor:
    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str, *,
                 backend: str, ds: dict, optim: dict, model: dict, seed: int, reference: bool = False):
        """ds: deepspeed_config's settings; optim: lr, betas, eps, weight_decay, max_norm, scheduler, warmup_ratio,
        min_lr_ratio, total_steps; model: attn_implementation, experts_implementation, gradient_checkpointing,
        reentrant, deterministic."""
        # LOCAL_RANK 0: Ray gives each rank actor its own GPU as device 0 (CUDA_VISIBLE_DEVICES).
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        import deepspeed
        from transformers import AutoModelForCausalLM, enable_full_determinism, get_scheduler
        from transformers.integrations.deepspeed import HfDeepSpeedConfig

        torch.manual_seed(seed)
        if model["deterministic"]:
            enable_full_determinism(seed)
        if backend == "gloo":
            make_collectives_synchronous()
        deepspeed.init_distributed(dist_backend=backend)
        self.rank, self.world_size, self.zero_stage = rank, world_size, ds["zero_stage"]
        ds_config = deepspeed_config(ds, optim["max_norm"])
        # Must exist (and stay referenced) before from_pretrained so transformers partitions weights for ZeRO-3.
        self._hf_ds_config = HfDeepSpeedConfig(ds_config) if self.zero_stage == 3 else None
        from openrlhf_async.config import attn_implementation

        load = {"dtype": TORCH_DTYPES[ds["dtype"]],
                "attn_implementation": attn_implementation(model["attn_implementation"], model["device"])}
        if model["experts_implementation"]:
            load["experts_implementation"] = model["experts_implementation"]
        policy = AutoModelForCausalLM.from_pretrained(model_path, **load)
        if model["gradient_checkpointing"]:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": model["reentrant"]})
        adam = dict(lr=optim["lr"], betas=tuple(optim["betas"]), eps=optim["eps"], weight_decay=optim["weight_decay"])
        if ds["adam_offload"]:  # ZeRO-Offload steps the optimizer on the CPU: DeepSpeed's own CPU Adam (AdamW)
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(policy.parameters(), adamw_mode=True, **adam)
        else:
            optimizer = torch.optim.AdamW(policy.parameters(), **adam)
        total = max(1, optim["total_steps"])
        extra = {"min_lr_rate": optim["min_lr_ratio"]} if optim["scheduler"] == "cosine_with_min_lr" else {}
        scheduler = get_scheduler(optim["scheduler"], optimizer, num_warmup_steps=math.ceil(optim["warmup_ratio"] * total),
                                  num_training_steps=total, scheduler_specific_kwargs=extra)
        self.engine, *_ = deepspeed.initialize(model=policy, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=ds_config)
        self.reference = None
        if reference:  # the initial policy, frozen (partitioned like the policy under ZeRO-3)
            ref_model = AutoModelForCausalLM.from_pretrained(model_path, **load)
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
        """Right-padded input ids, attention mask, a mask of response positions in the shifted targets, the rollout
        log-probs, the advantages and the proximal policy's log-probs ("old_logprobs"; None when no sample has
        them: the current policy is the proximal one)."""
        length = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
        ids = torch.zeros(len(samples), length, dtype=torch.long)
        attn = torch.zeros(len(samples), length, dtype=torch.long)
        resp = torch.zeros(len(samples), length - 1)
        old = torch.zeros(len(samples), length - 1)
        adv = torch.zeros(len(samples), length - 1)
        proximal = torch.zeros(len(samples), length - 1) if any("old_logprobs" in s for s in samples) else None
        for i, s in enumerate(samples):
            p, r = len(s["prompt_ids"]), len(s["response_ids"])
            ids[i, : p + r] = torch.tensor(s["prompt_ids"] + s["response_ids"])
            attn[i, : p + r] = 1
            # Target position t predicts token t+1; tokens the environment wrote (action_mask 0) are not trained.
            resp[i, p - 1 : p + r - 1] = torch.tensor(s.get("action_mask", [1] * r), dtype=torch.float32)
            if "logprobs" in s:
                old[i, p - 1 : p + r - 1] = torch.tensor(s["logprobs"], dtype=torch.float32)
            adv[i, p - 1 : p + r - 1] = s.get("advantage", 0.0)
            if proximal is not None and "old_logprobs" in s:
                proximal[i, p - 1 : p + r - 1] = torch.tensor(s["old_logprobs"], dtype=torch.float32)
        dev = self._device()
        return (ids.to(dev), attn.to(dev), resp.to(dev), old.to(dev), adv.to(dev),
                None if proximal is None else proximal.to(dev))

    def train_step(self, samples: list, totals: dict, num_micro_batches: int, loss_cfg: dict) -> dict:
        """One optimizer step over this rank's samples; the loss is aggregated over the global batch (totals: its
        response tokens and sequences). Every rank runs the same number of micro batches: ZeRO-3 gathers parameters
        collectively per forward. loss_cfg: see loss_settings."""
        with self.timeline.span("train"):
            return self._train_step(samples, totals, num_micro_batches, loss_cfg)

    def _reference_logprobs(self, ids, attn, temperature: float, chunk: int):
        """The reference model's log-probs, chunk samples per forward (--rollout.micro_batch_size)."""
        with torch.no_grad():
            return torch.cat([token_logprobs(self.reference(input_ids=ids[i : i + chunk],
                                                            attention_mask=attn[i : i + chunk]).logits[:, :-1],
                                             ids[i : i + chunk, 1:], temperature)
                              for i in range(0, len(ids), chunk)])

    def _train_step(self, samples: list, totals: dict, num_micro_batches: int, loss_cfg: dict) -> dict:
        self.engine.train()
        figures = dict.fromkeys(["loss", "clipped", "corrected", "weight", "vllm_kl", "kl", "entropy"], 0.0)
        tokens = 0
        size = -(-len(samples) // num_micro_batches) if samples else 1
        micro_batches = [samples[k * size : (k + 1) * size] or [EMPTY_SAMPLE] for k in range(num_micro_batches)]
        kl_cfg, agg = loss_cfg["kl"], loss_cfg["agg"]
        # GSPO's loss is a mean per sequence, as in OpenRLHF.
        agg = "seq-mean-token-mean" if loss_cfg["loss_type"] == "gspo" else agg
        share = dict(global_tokens=totals["tokens"], global_sequences=totals["sequences"])
        for k, micro in enumerate(micro_batches):
            ids, attn, mask, rollout_logp, adv, proximal = self._batch(micro)
            logits = self.engine(input_ids=ids, attention_mask=attn).logits[:, :-1]
            logp = token_logprobs(logits, ids[:, 1:], loss_cfg["temperature"])
            # The proximal policy (pi_old) the ratio is clipped against: the policy before the batch's first update
            # (recomputed, or the rollout's), or with a single update the current one (ratio 1, the clip idle).
            old_logp = logp.detach() if proximal is None else proximal
            ref_logp = kl = None
            if self.reference is not None and kl_cfg["coef"] > 0:
                ref_logp = self._reference_logprobs(ids, attn, loss_cfg["temperature"], loss_cfg["ref_micro_batch"])
                if not kl_cfg["use_loss"]:  # the KL as a per-token reward penalty, summed into later advantages
                    adv = adv + kl_reward_advantages(approx_kl(old_logp, ref_logp, kl_cfg["estimator"]), mask,
                                                     kl_cfg["coef"])
            out = policy_loss(logp, old_logp, rollout_logp, adv, mask, loss_cfg["clip"], loss_cfg["dual_clip"],
                              loss_cfg["loss_type"], loss_cfg["correction"])
            loss = aggregate(out["token_loss"], mask, agg, **share)
            if ref_logp is not None and kl_cfg["use_loss"]:
                kl = approx_kl(logp, ref_logp, kl_cfg["estimator"], old_logp, kl_cfg["unbiased_gradient"])
                loss = loss + kl_cfg["coef"] * aggregate(kl, mask, agg, **share)
            elif ref_logp is not None:
                kl = approx_kl(old_logp, ref_logp, kl_cfg["estimator"])
            if loss_cfg["entropy_coef"] is not None:
                entropy = token_entropy(logits, loss_cfg["temperature"])
                if loss_cfg["entropy_coef"]:
                    loss = loss - loss_cfg["entropy_coef"] * aggregate(entropy, mask, agg, **share)
                figures["entropy"] += float((entropy.detach() * mask).sum())
            # DeepSpeed averages gradients over ranks, so scale the global mean back up by world size.
            self.engine.set_gradient_accumulation_boundary(k == len(micro_batches) - 1)
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            figures["loss"] += float(loss)
            for key in ("clipped", "corrected", "weight", "vllm_kl"):
                figures[key] += float(out[key])
            if kl is not None:
                figures["kl"] += float((kl.detach() * mask).sum())
            tokens += int(mask.sum())
        self.engine.set_gradient_accumulation_boundary(True)
        lr = self.engine.get_lr()[0]  # the rate this step uses (step() moves the schedule on)
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        return {**figures, "tokens": tokens, "grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
                "lr": lr}

    @torch.no_grad()
    def proximal_logprobs(self, samples: list, num_micro_batches: int, temperature: float) -> list:
        """This rank's samples' log-probs at every response position (observations too) under the current weights:
        pi_old for the batch's updates. Every rank runs the same number of micro batches (ZeRO-3)."""
        with self.timeline.span("train"):
            self.engine.eval()
            size = -(-len(samples) // num_micro_batches) if samples else 1
            out = []
            for k in range(num_micro_batches):
                micro = samples[k * size : (k + 1) * size]
                ids, attn, *_ = self._batch(micro or [EMPTY_SAMPLE])
                logp = token_logprobs(self.engine(input_ids=ids, attention_mask=attn).logits[:, :-1], ids[:, 1:],
                                      temperature)
                for i, s in enumerate(micro):
                    p, r = len(s["prompt_ids"]), len(s["response_ids"])
                    out.append(logp[i, p - 1 : p + r - 1].tolist())
            return out

    @torch.no_grad()
    def forward_logprobs(self, samples: list, temperature: float = 1.0) -> list:
        """Per-response-token logprobs and greedy (argmax) tokens under the current weights.
        Under ZeRO-3 every rank must call this with the same samples (parameters are gathered collectively)."""
        self.engine.eval()
        ids, attn, mask, *_ = self._batch(samples)
        logits = self.engine(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logp = token_logprobs(logits, ids[:, 1:], temperature)
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
        kwargs = dict(backend=cfg.backend, ds=ds_settings(cfg), seed=cfg.train.seed,
                      reference=cfg.algo.kl_init_coef > 0, optim=optimizer_settings(cfg), model=model_settings(cfg))
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

    def train_batch(self, samples: list, micro_batch_size: int, loss_cfg: dict, mini_batch_size: int, epochs: int,
                    seed: int = 0) -> dict:
        """PPO's updates on a rollout batch: `epochs` passes over it in shuffled mini batches of `mini_batch_size`
        samples, each an optimizer step, all clipped against the same proximal policy: the weights before the first
        update (recomputed once here), or the rollout's own log-probs (loss_cfg["proximal"] "rollout"). With a
        single update the proximal policy is the current one and nothing is recomputed. Returns the figures'
        means over the updates, and their count."""
        import random

        per_epoch = -(-len(samples) // mini_batch_size)
        updates = epochs * per_epoch
        if loss_cfg["proximal"] == "rollout":
            samples = [{**s, "old_logprobs": s["logprobs"]} for s in samples]
        elif updates > 1:
            shards = self.shard(samples)
            num_micro = max(1, -(-max(len(s) for s in shards) // micro_batch_size))
            olds = get_all([a.proximal_logprobs.remote(shard, num_micro, loss_cfg["temperature"])
                            for a, shard in zip(self.actors, shards)])
            by_rank = [iter(o) for o in olds]
            samples = [{**s, "old_logprobs": next(by_rank[i % len(self.actors)])} for i, s in enumerate(samples)]
        rng, results = random.Random(seed), []
        for _ in range(epochs):
            order = list(range(len(samples)))
            if updates > 1:
                rng.shuffle(order)
            for k in range(0, len(order), mini_batch_size):
                results.append(self.train_step([samples[i] for i in order[k : k + mini_batch_size]], micro_batch_size,
                                               loss_cfg))
        figures = {key: sum(r[key] for r in results) / len(results) for key in results[0] if key != "tokens"}
        return {**figures, "grad_norm": results[-1]["grad_norm"], "tokens": sum(r["tokens"] for r in results),
                "updates": len(results)}

    def train_step(self, samples: list, micro_batch_size: int, loss_cfg: dict) -> dict:
        """One optimizer step on the batch; returns the step's loss figures (means over the batch's tokens)."""
        masks = [s.get("action_mask", [1] * len(s["response_ids"])) for s in samples]
        totals = {"tokens": max(1, sum(map(sum, masks))), "sequences": max(1, sum(1 for m in masks if any(m)))}
        shards = self.shard(samples)
        num_micro = max(1, -(-max(len(s) for s in shards) // micro_batch_size))
        results = get_all([
            a.train_step.remote(shard, totals, num_micro, loss_cfg) for a, shard in zip(self.actors, shards)
        ])
        total = {key: sum(r[key] for r in results) for key in results[0]}
        tokens = totals["tokens"]
        figures = {
            "loss": total["loss"],
            "clip_ratio": total["clipped"] / tokens,
            "is_weight_mean": total["weight"] / tokens,
            "is_filter_ratio": total["corrected"] / tokens,
            "vllm_kl": total["vllm_kl"] / tokens,
            "kl": total["kl"] / tokens,
            "grad_norm": results[0]["grad_norm"],
            "lr": results[0]["lr"],
            "tokens": total["tokens"],
        }
        if loss_cfg["entropy_coef"] is not None:
            figures["entropy"] = total["entropy"] / tokens
        return figures


def ds_settings(cfg) -> dict:
    d = cfg.ds
    return {"zero_stage": d.zero_stage, "dtype": cfg.dtype, "overlap_comm": d.overlap_comm, "zpg": d.zpg,
            "adam_offload": d.adam_offload and cfg.device == "cuda", "grad_accum_dtype": d.grad_accum_dtype}


def optimizer_settings(cfg) -> dict:
    a = cfg.actor
    return {"lr": a.adam_lr, "betas": a.adam_betas, "eps": a.adam_eps, "weight_decay": a.adam_weight_decay,
            "max_norm": a.max_norm, "scheduler": a.lr_scheduler, "warmup_ratio": a.lr_warmup_ratio,
            "min_lr_ratio": a.min_lr_ratio, "total_steps": cfg.train.max_steps * updates_per_step(cfg)}


def updates_per_step(cfg) -> int:
    """Optimizer steps per training step: --train.max_epochs passes over the rollout batch in mini batches of
    --train.batch_size samples."""
    t, r = cfg.train, cfg.rollout
    samples = r.batch_size * r.n_samples_per_prompt * (t.require_batches if cfg.mode == "fully_async" else 1)
    return t.max_epochs * -(-samples // t.batch_size)


def model_settings(cfg) -> dict:
    a = cfg.actor
    return {"attn_implementation": cfg.ds.attn_implementation, "device": cfg.device,
            "experts_implementation": cfg.ds.experts_implementation,
            "gradient_checkpointing": a.gradient_checkpointing_enable, "reentrant": a.gradient_checkpointing_reentrant,
            "deterministic": cfg.train.full_determinism_enable}


def loss_settings(cfg, **overrides) -> dict:
    """The loss settings PolicyGroup.train_step takes, from the run's config."""
    a, algo = cfg.actor, cfg.algo
    settings = {
        "proximal": a.proximal_policy, "clip": a.clip_range, "dual_clip": a.dual_clip, "loss_type": a.policy_loss_type, "agg": a.loss_agg_mode,
        "entropy_coef": a.entropy_coef, "temperature": cfg.rollout.temperature,
        "ref_micro_batch": cfg.rollout.micro_batch_size,
        "correction": {"level": algo.is_correction_level, "mode": algo.is_correction_mode,
                       "gating": algo.is_correction_gating, "threshold": tuple(algo.is_correction_threshold)},
        "kl": {"coef": algo.kl_init_coef, "use_loss": algo.kl_use_loss, "estimator": algo.kl_estimator,
               "unbiased_gradient": algo.kl_unbiased_gradient},
    }
    settings.update(overrides)
    return settings
