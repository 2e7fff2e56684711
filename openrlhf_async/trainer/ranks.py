"""The trainer's ranks as a group of Ray actors: their placement group (a bundle per rank), the fan-out of a call to
every rank, the plan of micro batches per rank (trainer/batching.py), PPO's epochs of mini batches, and each rank's
settings from the run's config. PolicyGroup is the policy's group (policy.py's ranks); the critic's is
critic.py's CriticGroup."""

import os
import random

from openrlhf_async.trainer.batching import plan
from openrlhf_async.trainer.policy import PolicyActor
from openrlhf_async.utils.ports import free_port
from openrlhf_async.utils.ray_utils import get_all


def _node_address() -> tuple:
    """(node id, IP, a free port) of the node this runs on."""
    import ray

    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), free_port()


def trainer_placement_group(cfg, world_size: int = None):
    """The ranks' placement group (of world_size ranks; the policy's by default), placed: a bundle per rank (as
    OpenRLHF and veRL place them). Ray refuses an empty bundle, so on cpu a rank's bundle holds a token share of a
    CPU."""
    import ray
    from ray.util.placement_group import placement_group

    bundle = {"GPU": 1, "CPU": 1} if cfg.device == "cuda" else {"CPU": 0.001}
    if cfg.hybrid and cfg.device == "cpu":  # the engines share these bundles: room for their --vllm.cpus_per_engine
        bundle = {"CPU": max(0.001, cfg.vllm.cpus_per_engine)}
    group = placement_group([bundle] * (world_size or cfg.actor.world_size), strategy=cfg.actor.placement_strategy)
    ray.get(group.ready())
    return group


def batch_totals(samples: list) -> dict:
    """The batch's response tokens the model wrote and its sequences with any: what the loss is averaged over."""
    masks = [s.get("action_mask", [1] * len(s["response_ids"])) for s in samples]
    return {"tokens": max(1, sum(map(sum, masks))), "sequences": max(1, sum(1 for m in masks if any(m)))}


class RankGroup:
    """A role's DeepSpeed ranks as Ray actors (actor_class), with the fan-out helpers the trainer loop calls."""

    actor_class = None

    def __init__(self, cfg, model_path: str, group=None):
        """group: the placement group to place the ranks in (a bundle each); None: one of their own. A group other
        models share (keeps_group: the hybrid engine's engines, colocated critic and reward models) outlives the
        ranks, and the ranks of a restart take it again."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from openrlhf_async.utils.cluster import HYBRID_GPU_SHARE

        actor_cls = ray.remote(self.actor_class)
        world = self.world_size(cfg)
        self.owns_group = not self.keeps_group(cfg)
        self.group = group or trainer_placement_group(cfg, world)

        def in_bundle(rank: int) -> dict:
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)
            return {"scheduling_strategy": strategy}

        # The rendezvous address and a free port are taken on rank 0's own node: Ray may place it on any node.
        self.rendezvous = ray.get(ray.remote(_node_address).options(num_cpus=0, **in_bundle(0)).remote())
        _, master_addr, master_port = self.rendezvous
        opts = {"num_gpus": HYBRID_GPU_SHARE if self.keeps_group(cfg) else 1, "num_cpus": 0} \
            if cfg.device == "cuda" else {"num_cpus": 0}
        env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // world))} if cfg.device == "cpu" else {}
        self.actors = [
            actor_cls.options(**opts, **in_bundle(rank), runtime_env={"env_vars": env}).remote(
                rank, world, master_addr, master_port, model_path, **self.settings(cfg))
            for rank in range(world)
        ]
        get_all([a.ready.remote() for a in self.actors])
        self.batching = batching_settings(cfg)
        # --ds.ring_attn_size: each group of this many consecutive ranks shares every micro batch; its first rank
        # reports (trainer/sequence_parallel.py)
        self.sequence_size = cfg.ds.ring_attn_size

    @staticmethod
    def world_size(cfg) -> int:
        raise NotImplementedError

    @staticmethod
    def keeps_group(cfg) -> bool:
        """Other models share the ranks' bundles (each rank then takes a share of its GPU)."""
        raise NotImplementedError

    @staticmethod
    def settings(cfg) -> dict:
        """Each rank's keyword arguments (its actor_class's)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Kill the ranks and free their placement (a trainer that restarts after a rank died)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if self.owns_group:
            remove_placement_group(self.group)

    def call(self, method: str, *args, **kwargs) -> list:
        """Start the same method on every rank; returns the object refs."""
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def _plan(self, samples: list, size: int, max_tokens) -> tuple:
        """Per rank, its micro batches as lists of samples, and per data-parallel group (a rank, or a sequence-parallel
        group) as lists of their indices (batching.plan). A sequence-parallel group's micro batches hold its ranks'
        token budgets together."""
        n = self.sequence_size
        indices = plan(samples, len(self.actors) // n, size, max_tokens and max_tokens * n, self.batching["packing"])
        per_group = [[[samples[i] for i in batch] for batch in batches] for batches in indices]
        return [per_group[rank // n] for rank in range(len(self.actors))], indices

    def _reports(self, results: list) -> list:
        """The results of each data-parallel group's first rank (the others of a sequence-parallel group computed the
        same figures)."""
        return results[:: self.sequence_size]

    def _per_sample(self, samples: list, method: str, *args) -> list:
        """Each sample's list from the ranks' `method(micro_batches, *args)` (one list per sample per micro batch),
        run in the log-prob passes' micro batches (--rollout.micro_batch_size or --rollout.max_tokens_per_gpu)."""
        b = self.batching
        batches, indices = self._plan(samples, b["logprobs_micro_batch_size"], b["logprobs_max_tokens"])
        results = self._reports(get_all([getattr(a, method).remote(micro, *args)
                                         for a, micro in zip(self.actors, batches)]))
        out = [None] * len(samples)
        for rank_indices, rank_results in zip(indices, results):
            for batch, values in zip(rank_indices, rank_results):
                for i, v in zip(batch, values):
                    out[i] = v
        return out

    def _train_on_ranks(self, samples: list, micro_batch_size: int, loss_cfg: dict) -> tuple:
        """One optimizer step of every rank on its share of the batch, in micro batches of micro_batch_size samples
        or, with --train.dynamic_batch_enable, of --train.max_tokens_per_gpu tokens: (each rank's figures, the
        batch's totals)."""
        totals = batch_totals(samples)
        batches, _ = self._plan(samples, micro_batch_size, self.batching["max_tokens"])
        results = get_all([a.train_step.remote(micro, totals, loss_cfg, self.batching)
                           for a, micro in zip(self.actors, batches)])
        return self._reports(results), totals

    def _updates(self, samples: list, micro_batch_size: int, loss_cfg: dict, mini_batch_size: int, epochs: int,
                 seed: int) -> list:
        """train_step's figures of each update: `epochs` passes over the samples in mini batches, shuffled by seed
        (the same for the policy and the critic) unless there is only one."""
        updates = epochs * -(-len(samples) // mini_batch_size)
        rng, results = random.Random(seed), []
        for _ in range(epochs):
            order = list(range(len(samples)))
            if updates > 1:
                rng.shuffle(order)
            for k in range(0, len(order), mini_batch_size):
                results.append(self.train_step([samples[i] for i in order[k : k + mini_batch_size]], micro_batch_size,
                                               loss_cfg))
        return results

    def train_step(self, samples: list, micro_batch_size: int, loss_cfg: dict) -> dict:
        raise NotImplementedError


class PolicyGroup(RankGroup):
    """The policy's ranks: log-probs, the reference's log-probs, PPO's updates."""

    actor_class = PolicyActor

    @staticmethod
    def world_size(cfg) -> int:
        return cfg.actor.world_size

    @staticmethod
    def keeps_group(cfg) -> bool:
        return cfg.hybrid or "policy" in cfg.placement.values()

    @staticmethod
    def settings(cfg) -> dict:
        return dict(backend=cfg.backend, ds=ds_settings(cfg), seed=cfg.train.seed,
                    reference=cfg.algo.kl_init_coef > 0, optim=optimizer_settings(cfg), model=model_settings(cfg))

    def logprobs(self, samples: list, temperature: float, reference: bool = False, top_p: float = 1.0) -> list:
        """Each sample's log-probs at its response positions under the current weights (or the reference model's),
        in passes of --rollout.micro_batch_size samples or --rollout.max_tokens_per_gpu tokens; top_p < 1: of the
        rollout's nucleus distribution."""
        return self._per_sample(samples, "logprobs", temperature, self.batching, reference, top_p)

    def with_reference(self, samples: list, temperature: float, kl_coef: float, top_p: float) -> list:
        """The samples with the reference model's log-probs ("ref_logprobs") where the KL has a coefficient, computed
        before the updates as OpenRLHF's experience maker does (a pass per training micro batch would run a different
        number of ZeRO-3 gathers per rank). top_p < 1: of the reference's own nucleus, as the policy's are of its
        own: against the whole distribution a policy equal to its reference would show a KL of -log(nucleus mass).
        top_p has no default, so that no caller compares a nucleus with a whole distribution by leaving it out."""
        if kl_coef <= 0 or all("ref_logprobs" in s for s in samples):
            return samples
        refs = self.logprobs(samples, temperature, reference=True, top_p=top_p)
        return [{**s, "ref_logprobs": ref} for s, ref in zip(samples, refs)]

    def train_batch(self, samples: list, micro_batch_size: int, loss_cfg: dict, mini_batch_size: int, epochs: int,
                    seed: int = 0) -> dict:
        """PPO's updates on a rollout batch: `epochs` passes over it in shuffled mini batches of `mini_batch_size`
        samples, each an optimizer step, all clipped against the same proximal policy: the weights before the first
        update (recomputed once here), or the rollout's own log-probs (loss_cfg["proximal"] "rollout"). With a
        single update the proximal policy is the current one and nothing is recomputed. Returns the figures'
        means over the updates, and their count."""
        per_epoch = -(-len(samples) // mini_batch_size)
        updates = epochs * per_epoch
        samples = self.with_reference(samples, loss_cfg["temperature"], loss_cfg["kl"]["coef"], loss_cfg["top_p"])
        if loss_cfg["proximal"] == "rollout":
            samples = [{**s, "old_logprobs": s["logprobs"]} for s in samples]
        elif updates > 1 and not all("old_logprobs" in s for s in samples):  # gae's come with them
            olds = self.logprobs(samples, loss_cfg["temperature"], top_p=loss_cfg["top_p"])
            samples = [{**s, "old_logprobs": old} for s, old in zip(samples, olds)]
        results = self._updates(samples, micro_batch_size, loss_cfg, mini_batch_size, epochs, seed)
        figures = {key: sum(r[key] for r in results) / len(results) for key in results[0] if key != "tokens"}
        return {**figures, "grad_norm": results[-1]["grad_norm"], "tokens": sum(r["tokens"] for r in results),
                "updates": len(results)}

    def train_step(self, samples: list, micro_batch_size: int, loss_cfg: dict) -> dict:
        """One optimizer step on the batch (see _train_on_ranks); returns the step's loss figures (means over the
        batch's tokens)."""
        samples = self.with_reference(samples, loss_cfg["temperature"], loss_cfg["kl"]["coef"], loss_cfg["top_p"])
        results, totals = self._train_on_ranks(samples, micro_batch_size, loss_cfg)
        total = {key: sum(r[key] for r in results) for key in results[0]}
        tokens = totals["tokens"]
        figures = {
            "loss": total["loss"],
            "clip_ratio": total["clipped"] / tokens,
            "is_weight_mean": total["weight"] / tokens,
            "is_filter_ratio": total["corrected"] / tokens,
            "vllm_kl": total["vllm_kl"] / tokens,
            # |vLLM's log-prob - the trainer's| over the step's model tokens: the mismatch the correction absorbs
            "vllm_logprob_gap_mean": total["vllm_gap"] / tokens,
            "vllm_logprob_gap_max": max(r["vllm_gap_max"] for r in results),
            "kl": total["kl"] / tokens,
            "grad_norm": results[0]["grad_norm"],
            "lr": results[0]["lr"],
            "tokens": total["tokens"],
        }
        if loss_cfg["entropy_coef"] is not None:
            figures["entropy"] = total["entropy"] / tokens
        if total["routes_tokens"]:  # a mixture of experts': of its tokens and MoE layers, the share with vLLM's
            # routes (all but each sample's last token, never fed back, where every request's were recorded) and of
            # those the share the trainer's own routing sends elsewhere
            figures["routing/recorded_share"] = total["routes_known"] / total["routes_tokens"]
        if total["routes_known"]:
            figures["routing/differ_share"] = total["routes_differ"] / total["routes_known"]
        return figures


# ---- each rank's settings from the run's config --------------------------------------------------------------------

def ds_settings(cfg) -> dict:
    """DeepSpeed's settings of a rank (rank.deepspeed_config), the policy's LoRA adapter among them."""
    d = cfg.ds
    return {"zero_stage": d.zero_stage, "dtype": cfg.dtype, "overlap_comm": d.overlap_comm, "zpg": d.zpg,
            "adam_offload": d.adam_offload, "grad_accum_dtype": d.grad_accum_dtype, "ref_offload": cfg.ref.offload,
            "ring_attn_size": d.ring_attn_size,
            "enable_sleep": d.enable_sleep and cfg.hybrid,
            "lora": {"rank": d.lora_rank, "alpha": d.lora_alpha, "dropout": d.lora_dropout,
                     "target_modules": d.lora_target_modules} if d.lora_rank else None}


def optimizer_settings(cfg, role: str = "actor") -> dict:
    """The optimizer and schedule of a role's ranks from its section (--actor.* or --critic.*, the same fields), over
    the run's optimizer steps."""
    a = getattr(cfg, role)
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
    """How a rank builds and runs its model (attention, experts, gradient checkpointing, determinism)."""
    a = cfg.actor
    return {"attn_implementation": cfg.ds.attn_implementation, "device": cfg.device,
            "experts_implementation": cfg.ds.experts_implementation,
            "gradient_checkpointing": a.gradient_checkpointing_enable, "reentrant": a.gradient_checkpointing_reentrant,
            "deterministic": cfg.train.full_determinism_enable, "routing_replay": a.routing_replay}


def batching_settings(cfg) -> dict:
    """How samples become forward passes (trainer/batching.py): token budgets (None: fixed micro batch sizes),
    packing, the log-softmax chunk, and the micro batches of the passes that only compute log-probs."""
    dynamic = cfg.train.dynamic_batch_enable
    return {"max_tokens": cfg.train.max_tokens_per_gpu if dynamic else None, "packing": cfg.ds.packing_samples,
            "chunk": cfg.actor.logprobs_chunk_size, "logprobs_micro_batch_size": cfg.rollout.micro_batch_size,
            "logprobs_max_tokens": cfg.rollout.max_tokens_per_gpu if dynamic else None}


def loss_settings(cfg, **overrides) -> dict:
    """The loss settings PolicyGroup.train_step takes, from the run's config."""
    a, algo = cfg.actor, cfg.algo
    settings = {
        "proximal": a.proximal_policy, "clip": a.clip_range, "dual_clip": a.dual_clip, "loss_type": a.policy_loss_type, "agg": a.loss_agg_mode,
        "entropy_coef": a.entropy_coef, "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
        "correction": {"level": algo.is_correction_level, "mode": algo.is_correction_mode,
                       "gating": algo.is_correction_gating, "threshold": tuple(algo.is_correction_threshold or ())},
        "kl": {"coef": algo.kl_init_coef, "use_loss": algo.kl_use_loss, "estimator": algo.kl_estimator,
               "unbiased_gradient": algo.kl_unbiased_gradient},
    }
    settings.update(overrides)
    return settings
