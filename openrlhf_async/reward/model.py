"""Reward models (--reward.model_name_or_path): OpenRLHF's reward-model checkpoints (a causal LM body with a one-output
`score` head, models/value.py's ValueModel) served by Ray actors that score finished episodes as they arrive.

Each actor holds the model whole (one per --reward.num_gpus_per_node x --reward.num_nodes) and scores the text of an
episode (prompt and response, as OpenRLHF's serve_rm takes it) with the model's own tokenizer: the value at the last
token, normalised by the (mean, std) stored in its config.json with --reward.normalize_enable. Calls that arrive
while a forward runs wait and go together into the next one, so episodes finishing across groups and engines are
batched (at most --rollout.micro_batch_size sequences a forward). Several models (comma-separated) each score every
episode; their rewards add up. The engines' reward source over the actors is ModelReward (reward/sources.py): a dead
or hung actor is a counted reward error, the run goes on."""

import asyncio
import os
import uuid

import torch

from openrlhf_async.reward.sources import NAMESPACE

_STARTED = []


class RewardModelActor:
    """One reward model, scoring texts in batches (a Ray actor with an event loop: calls run concurrently)."""

    def __init__(self, model_path: str, head_prefix: str, dtype: str, device: str, normalize: bool, max_len: int,
                 micro_batch_size: int, name: str = "reward model"):
        from transformers import AutoTokenizer

        from openrlhf_async.utils.timeline import Timeline

        from openrlhf_async.models.value import DTYPES, build_value_model

        self.model = build_value_model(model_path, {"dtype": DTYPES[dtype]}, head_prefix).eval()
        self.device = "cuda" if device == "cuda" else "cpu"
        self.model.to(self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        config = self.model.config
        self.shift, self.scale = ((getattr(config, "mean", 0.0), getattr(config, "std", 1.0)) if normalize
                                  else (0.0, 1.0))
        self.max_len, self.micro_batch_size = max_len, micro_batch_size
        self.pending, self.busy = [], False
        self.figures = {"forwards": 0, "sequences": 0}
        self.timeline = Timeline(name)

    def ready(self) -> bool:
        return True

    def take_spans(self) -> list:
        return self.timeline.take()

    def stats(self) -> dict:
        return dict(self.figures)

    async def score(self, texts: list) -> list:
        """The model's reward of each text; batched with the calls that arrive while a forward runs."""
        done = asyncio.get_running_loop().create_future()
        self.pending.append((texts, done))
        if not self.busy:
            self.busy = True
            asyncio.ensure_future(self._drain())
        return await done

    async def _drain(self) -> None:
        try:
            while self.pending:
                calls, self.pending = self.pending, []
                texts = [t for batch, _ in calls for t in batch]
                try:
                    with self.timeline.span("reward model"):
                        rewards = await asyncio.to_thread(self._forward, texts)
                except Exception as e:  # every waiting call fails with it: counted as reward errors
                    for _, done in calls:
                        done.set_exception(RuntimeError(f"reward model: {type(e).__name__}: {e}"))
                    continue
                at = 0
                for batch, done in calls:
                    done.set_result(rewards[at : at + len(batch)])
                    at += len(batch)
        finally:
            self.busy = False

    @torch.no_grad()
    def _forward(self, texts: list) -> list:
        out = []
        for k in range(0, len(texts), self.micro_batch_size):
            batch = self.tokenizer(texts[k : k + self.micro_batch_size], add_special_tokens=False, truncation=True,
                                   max_length=self.max_len, padding=True, return_tensors="pt")
            ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
            # Right or left padding alike: position ids count the real tokens; the reward is at the last one.
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
            values = self.model(ids, attention_mask=mask, position_ids=positions).float()
            last = mask.shape[1] - 1 - mask.long().flip(-1).argmax(-1)
            out += ((values.gather(1, last.unsqueeze(1)).squeeze(1) - self.shift) / self.scale).tolist()
            self.figures["forwards"] += 1
        self.figures["sequences"] += len(texts)
        return out


def reward_model_names(cfg) -> tuple:
    """The run's reward-model actors' names, per model in --reward.model_name_or_path: --reward.num_nodes x
    --reward.num_gpus_per_node each. Known before the actors start, so that the engines (which find them by name)
    can start first."""
    r = cfg.reward
    paths = [p.strip() for p in (r.model_name_or_path or "").split(",") if p.strip()]
    run = uuid.uuid4().hex[:12]
    return tuple(tuple(f"openrlhf_async-reward-{run}-{m}-{i}" for i in range(r.num_nodes * r.num_gpus_per_node))
                 for m in range(len(paths)))


def start_reward_models(cfg, group=None) -> None:
    """Start the reward-model actors named in cfg.reward.models that are not running (none at a restart, unless one
    died). group: the placement group whose bundles they share (cfg.placement: the policy's or the critic's), actor
    i of each model in bundle i with a share of its GPU; None: a GPU each of their own."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from openrlhf_async.utils.cluster import HYBRID_GPU_SHARE

    r = cfg.reward
    paths = [p.strip() for p in (r.model_name_or_path or "").split(",") if p.strip()]
    opts = {"num_gpus": HYBRID_GPU_SHARE if group else 1, "num_cpus": 0} if cfg.device == "cuda" else {"num_cpus": 0}
    actors = []
    for m, (path, names) in enumerate(zip(paths, cfg.reward.models)):
        for i, name in enumerate(names):
            try:
                ray.get_actor(name, namespace=NAMESPACE)
                continue
            except ValueError:
                pass
            place = {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=i % len(group.bundle_specs))} if group else {}
            actors.append(ray.remote(RewardModelActor).options(name=name, namespace=NAMESPACE, max_concurrency=1000,
                                                               **opts, **place).remote(
                path, cfg.ds.value_head_prefix, cfg.dtype, cfg.device, r.normalize_enable, cfg.data.max_len,
                cfg.rollout.micro_batch_size, f"reward model {m}.{i}"))
    ray.get([a.ready.remote() for a in actors])
    _STARTED.extend(actors)  # a named actor still ends when its creator drops every handle: the driver keeps them


def reward_model_actors(cfg) -> list:
    """The run's reward-model actors (none without --reward.model_name_or_path, or before they started)."""
    import ray

    out = []
    for name in (n for group in cfg.reward.source()["models"] for n in group):
        try:
            out.append(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:  # it died: its spans are gone with it
            pass
    return out
