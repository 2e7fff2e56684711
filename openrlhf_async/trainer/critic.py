"""PPO's critic (--algo.advantage.estimator gae): a value model (models/value.py: a causal LM's body with a head of
one output, as OpenRLHF defines it) trained with the clipped value loss by a DeepSpeed group of Ray actors of its own
beside the policy's (the same ZeRO stages, checkpoints and micro batches: CriticActor is a DeepSpeed rank, rank.py, as
the policy's are, around another model and loss). The run holds it beside the policy's group (trainer/run.py), not
the policy's group."""

import torch

from openrlhf_async.models.value import build_value_model
from openrlhf_async.trainer.batching import Layout, row_inputs, sample_length
from openrlhf_async.trainer.losses import aggregate, value_loss
from openrlhf_async.trainer.rank import EMPTY_SAMPLE, DeepSpeedRank
from openrlhf_async.trainer.ranks import RankGroup, ds_settings, model_settings, optimizer_settings


class CriticActor(DeepSpeedRank):
    """A critic rank: a DeepSpeed engine around a value model, trained with the clipped value loss."""

    role = "critic"

    def _build(self, model_path, load: dict, model: dict, ds: dict):
        critic = build_value_model(model_path, load, ds["value_head_prefix"])
        if model["gradient_checkpointing"]:
            critic.body.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": model["reentrant"]})
        return critic

    def _values(self, samples: list, layout: dict) -> torch.Tensor:
        """[B, T] values at each sample's target positions (position t is the state before token t + 1)."""
        inputs = Layout.of(samples, layout["packing"]).to(self._device())
        model_inputs, _, context, finish = row_inputs(inputs, self.sequence)
        with context:
            values = self.engine(**model_inputs)
        return inputs.per_sample(finish(values.float()))

    @torch.no_grad()
    def values(self, micro_batches: list, layout: dict) -> list:
        """Each sample's values at its response positions; per micro batch, a list per sample."""
        with self.timeline.span("critic"):
            self.engine.eval()
            out = []
            for micro in micro_batches:
                values = self._values(micro or [EMPTY_SAMPLE], layout)
                out.append([values[i, len(s["prompt_ids"]) - 1 : sample_length(s) - 1].tolist()
                            for i, s in enumerate(micro)])
            return out

    def train_step(self, micro_batches: list, totals: dict, loss_cfg: dict, layout: dict) -> dict:
        with self.timeline.span("critic"):
            return self._train_step(micro_batches, totals, loss_cfg, layout)

    def _train_step(self, micro_batches: list, totals: dict, loss_cfg: dict, layout: dict) -> dict:
        """One optimizer step of the value loss (the clipped one, token-mean over the batch's response tokens the
        model wrote, as OpenRLHF's ValueLoss)."""
        self.engine.train()
        figures = {"value_loss": 0.0, "value_clipped": 0.0, "values": 0.0}
        share = dict(global_tokens=totals["tokens"], global_sequences=totals["sequences"])
        for k, micro in enumerate(micro_batches):
            micro = micro or [EMPTY_SAMPLE]
            rows = self._targets(micro)
            mask = rows["mask"]
            values = self._values(micro, layout)
            old, returns = (rows[key] if rows[key] is not None else torch.zeros_like(values)
                            for key in ("values", "returns"))
            loss = aggregate(value_loss(values, old, returns, loss_cfg["value_clip"]), mask, "token-mean", **share)
            self._backward(loss, last=k == len(micro_batches) - 1)
            figures["value_loss"] += float(loss)
            if loss_cfg["value_clip"] is not None:
                figures["value_clipped"] += float((((values - old).abs() > loss_cfg["value_clip"]) * mask).sum())
            figures["values"] += float((values.detach() * mask).sum())
        lr, grad_norm = self._optimizer_step()
        return {**figures, "grad_norm": grad_norm, "lr": lr}

    def save_hf(self, path: str, merged: bool = False) -> None:
        """The critic in OpenRLHF's format (--critic.save_value_network), from rank 0."""
        import deepspeed

        state = {}
        for name, param in self.engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], enabled=self.zero_stage == 3):
                if self.rank == 0:
                    state[name] = param.data.detach().cpu().clone()
        if self.rank == 0:
            self.engine.module.save(path, state)


class CriticGroup(RankGroup):
    """The critic's ranks (--critic.num_nodes x --critic.num_gpus_per_node): a placement group of their own, or the
    policy's bundles with --train.colocate_all (cfg.placement)."""

    actor_class = CriticActor

    @staticmethod
    def world_size(cfg) -> int:
        return cfg.critic.world_size

    @staticmethod
    def keeps_group(cfg) -> bool:
        """In the policy's bundles (not its own group), or hosting the reward models (--train.colocate_critic_reward:
        they outlive a restart's ranks)."""
        return cfg.placement["critic"] == "policy" or cfg.placement["rewards"] == "critic"

    @staticmethod
    def settings(cfg) -> dict:
        # The hybrid engine's sleep offloads the critic's states with the policy's (ds_settings' enable_sleep).
        ds = {**ds_settings(cfg), "lora": None, "value_head_prefix": cfg.ds.value_head_prefix}
        return dict(backend=cfg.backend, ds=ds, seed=cfg.train.seed, optim=optimizer_settings(cfg, "critic"),
                    model=model_settings(cfg))

    def values(self, samples: list) -> list:
        """Each sample's values at its response positions, in the log-prob passes' micro batches."""
        return self._per_sample(samples, "values", self.batching)

    def train_step(self, samples: list, micro_batch_size: int, loss_cfg: dict) -> dict:
        """One optimizer step of the value loss on the batch (see _train_on_ranks); the figures as OpenRLHF names
        them."""
        results, totals = self._train_on_ranks(samples, micro_batch_size, loss_cfg)
        total = {key: sum(r[key] for r in results) for key in ("value_loss", "value_clipped", "values")}
        tokens = totals["tokens"]
        return {"critic/value_loss": total["value_loss"], "critic/clip_ratio": total["value_clipped"] / tokens,
                "critic/values_mean": total["values"] / tokens, "critic/grad_norm": results[0]["grad_norm"],
                "critic/lr": results[0]["lr"]}

    def train_batch(self, samples: list, micro_batch_size: int, loss_cfg: dict, mini_batch_size: int, epochs: int,
                    seed: int = 0) -> dict:
        """The value loss's updates on a rollout batch, in the policy's mini batches and epochs (the same shuffles):
        the samples carry the values their returns were computed with ("values") and the returns."""
        results = self._updates(samples, micro_batch_size, loss_cfg, mini_batch_size, epochs, seed)
        return {key: sum(r[key] for r in results) / len(results) for key in results[0]}


def start_critic(cfg, model_path: str, policy, group=None):
    """PPO's critic when the run trains one (--algo.advantage.estimator gae), else None: from
    --critic.model_name_or_path, else as OpenRLHF picks it: the (first) reward model when it alone scores (no
    --reward.remote_url, no --train.agent_func_path), else the actor's model (its head then starts at random). Its
    ranks go in the policy's bundles (`policy`: its PolicyGroup) with --train.colocate_all, else in `group` (the
    critic's kept group, which the reward models share) or a group of their own."""
    if cfg.algo.advantage_estimator != "gae":
        return None
    reward_models = [p.strip() for p in (cfg.reward.model_name_or_path or "").split(",") if p.strip()]
    alone = reward_models and not cfg.reward.remote_url and not cfg.agent.func_path
    group = policy.group if cfg.placement["critic"] == "policy" else group
    return CriticGroup(cfg, cfg.critic.model_name_or_path or (reward_models[0] if alone else model_path), group)
