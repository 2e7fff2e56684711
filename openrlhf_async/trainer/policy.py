"""The policy rank: a DeepSpeed rank (rank.py) around the causal LM, with LoRA a peft adapter on it, trained with the
DAPO/GRPO loss and an off-policy correction against the rollout logprobs; optionally a frozen reference model for a KL
penalty, in a DeepSpeed config of its own (frozen_model_config), or with LoRA the policy with its adapter disabled.

Each rank also holds the trainer's side of the weight transfer into the vLLM engines (weight_export.py); its remote
methods are the ones below that hand over to it. The ranks' group is trainer/ranks.py."""

import contextlib
import os

import torch

from openrlhf_async.trainer.batching import Layout, sample_length, target_logprobs
from openrlhf_async.trainer.losses import (
    aggregate,
    approx_kl,
    kl_reward_advantages,
    policy_loss,
    token_logprobs,
)
from openrlhf_async.trainer.rank import EMPTY_SAMPLE, DeepSpeedRank, frozen_model_config
from openrlhf_async.trainer.routing_replay import RoutingReplay, layout_routes
from openrlhf_async.trainer.weight_export import WeightExport, probe_ids


def _build_model(model_path, load: dict):
    """The model from its folder, or (model_path a transformers config) randomly initialised in that shape: how
    benchmarks/gpu_check.py trains real shapes without their weights. Under ZeRO-3 both are partitioned as built."""
    from transformers import AutoModelForCausalLM, PretrainedConfig

    if isinstance(model_path, PretrainedConfig):
        return AutoModelForCausalLM.from_config(model_path, **load)
    return AutoModelForCausalLM.from_pretrained(model_path, **load)


def _with_adapter(model, lora: dict, checkpointing: bool):
    """The model with a LoRA adapter (peft) on lora["target_modules"]: only the adapter trains. Its B starts at zero,
    so the wrapped model is the base model until the first step."""
    from peft import LoraConfig, get_peft_model

    if checkpointing:  # the frozen embeddings' output must require grad, or checkpointed layers pass none back
        model.enable_input_require_grads()
    config = LoraConfig(task_type="CAUSAL_LM", r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                        target_modules=lora["target_modules"], bias="none")
    # The adapter in the base's dtype: DeepSpeed keeps one dtype per engine (and its fp32 master copies).
    return get_peft_model(model, config, autocast_adapter_dtype=False)


class PolicyActor(DeepSpeedRank):
    """A policy rank: log-probs (the policy's or the reference's), the policy loss's optimizer step, the HF export, and
    the weights the engines load."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path, *,
                 reference: bool = False, **settings):
        """settings: DeepSpeedRank's (backend, ds, optim, model, seed); reference: load a frozen reference model for
        the KL penalty."""
        super().__init__(rank, world_size, master_addr, master_port, model_path, **settings)
        # With LoRA the reference model is the policy with its adapter disabled: no second copy of the weights.
        self.reference = (self._load_reference(model_path, frozen_model_config(settings["ds"]))
                          if reference and not self.lora else None)
        self.weights = WeightExport(self.engine.module, self.lora, self.zero_stage, rank, self.timeline)
        # A mixture of experts: the rollout's routes replayed (or, with --no-actor.routing_replay, only compared)
        self.replay = RoutingReplay.of(self.engine.module, settings["model"].get("routing_replay", True))

    def _build(self, model_path, load: dict, model: dict, ds: dict):
        """The trained model (see model_settings), before DeepSpeed wraps it: the causal LM, with its adapter."""
        policy = _build_model(model_path, load)
        if model["gradient_checkpointing"]:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": model["reentrant"]})
        if self.lora:
            policy = _with_adapter(policy, ds["lora"], model["gradient_checkpointing"])
        return policy

    def _load_reference(self, model_path: str, ds_config: dict):
        """The initial policy, frozen, in a DeepSpeed engine of its own config (frozen_model_config)."""
        import deepspeed
        from transformers import AutoModelForCausalLM
        from transformers.integrations.deepspeed import HfDeepSpeedConfig, set_hf_deepspeed_config

        # Under ZeRO-3 from_pretrained partitions the weights by the one config transformers holds (the last one
        # made): the reference's for this load (its parameter offload), then the policy's again.
        hf_ds_config = HfDeepSpeedConfig(ds_config) if self.zero_stage == 3 else None
        model = AutoModelForCausalLM.from_pretrained(model_path, **self.load)
        if hf_ds_config is not None:
            set_hf_deepspeed_config(self._hf_ds_config)
        engine, *_ = deepspeed.initialize(model=model.eval().requires_grad_(False), config=ds_config)
        return engine

    # ---- training ----------------------------------------------------------------------------------------------

    def _logprobs(self, model, samples: list, temperature: float, layout: dict, entropy: bool = False,
                  top_p: float = 1.0):
        """[B, T] log-probs (and entropies) of one forward pass over samples, laid out as layout says (packing,
        chunk: see batching_settings); top_p < 1: of the rollout's nucleus distribution."""
        inputs = Layout.of(samples, layout["packing"]).to(self._device())
        # The policy's own forward (not the reference's), rows whole on this rank: a row split across a
        # sequence-parallel group gets no routes (replay with one is refused at start, config/checks.py).
        if self.replay is not None:
            config = self.engine.module.config
            routes = None if model is self.reference or self.sequence is not None else layout_routes(
                samples, inputs.ids.shape[1], layout["packing"], config.num_hidden_layers, config.num_experts_per_tok)
            self.replay.set(None if routes is None else routes.to(self._device()))
        return target_logprobs(model, inputs, temperature, layout["chunk"], entropy, top_p, self.sequence)

    def train_step(self, micro_batches: list, totals: dict, loss_cfg: dict, layout: dict) -> dict:
        """One optimizer step over this rank's micro batches (lists of samples; an empty one stands in where the
        rank has none left: every rank runs as many, as ZeRO-3 gathers parameters collectively per forward). The
        loss is aggregated over the global batch (totals: its response tokens and sequences). loss_cfg: see
        loss_settings; layout: see batching_settings."""
        with self.timeline.span("train"):
            return self._train_step(micro_batches, totals, loss_cfg, layout)

    def _train_step(self, micro_batches: list, totals: dict, loss_cfg: dict, layout: dict) -> dict:
        self.engine.train()
        figures = dict.fromkeys(["loss", "clipped", "corrected", "weight", "vllm_kl", "vllm_gap", "vllm_gap_max", "kl",
                                 "entropy", "routes_tokens"], 0.0)
        if self.replay is not None:
            self.replay.take_counts()  # from this step's forward passes on
        tokens = 0
        kl_cfg, agg = loss_cfg["kl"], loss_cfg["agg"]
        # GSPO's loss is a mean per sequence, as in OpenRLHF.
        agg = "seq-mean-token-mean" if loss_cfg["loss_type"] == "gspo" else agg
        share = dict(global_tokens=totals["tokens"], global_sequences=totals["sequences"])
        for k, micro in enumerate(micro_batches):
            micro = micro or [EMPTY_SAMPLE]
            rows = self._targets(micro)
            mask, adv = rows["mask"], rows["advantage"]
            logp, entropy = self._logprobs(self.engine, micro, loss_cfg["temperature"], layout,
                                           entropy=loss_cfg["entropy_coef"] is not None, top_p=loss_cfg["top_p"])
            # The proximal policy (pi_old) the ratio is clipped against: the policy before the batch's first update
            # (recomputed, or the rollout's), or with a single update the current one (ratio 1, the clip idle).
            old_logp = logp.detach() if rows["old_logprobs"] is None else rows["old_logprobs"]
            ref_logp, kl = (rows["ref_logprobs"] if kl_cfg["coef"] > 0 else None), None
            if ref_logp is not None and not kl_cfg["use_loss"]:
                # The KL as a per-token reward penalty, summed into later advantages.
                adv = adv + kl_reward_advantages(approx_kl(old_logp, ref_logp, kl_cfg["estimator"]), mask,
                                                 kl_cfg["coef"])
            out = policy_loss(logp, old_logp, rows["logprobs"], adv, mask, loss_cfg["clip"], loss_cfg["dual_clip"],
                              loss_cfg["loss_type"], loss_cfg["correction"])
            loss = aggregate(out["token_loss"], mask, agg, **share)
            if ref_logp is not None and kl_cfg["use_loss"]:
                kl = approx_kl(logp, ref_logp, kl_cfg["estimator"], old_logp, kl_cfg["unbiased_gradient"])
                loss = loss + kl_cfg["coef"] * aggregate(kl, mask, agg, **share)
            elif ref_logp is not None:
                kl = approx_kl(old_logp, ref_logp, kl_cfg["estimator"])
            if entropy is not None:
                if loss_cfg["entropy_coef"]:
                    loss = loss - loss_cfg["entropy_coef"] * aggregate(entropy, mask, agg, **share)
                figures["entropy"] += float((entropy.detach() * mask).sum())
            self._backward(loss, last=k == len(micro_batches) - 1)
            figures["loss"] += float(loss)
            for key in ("clipped", "corrected", "weight", "vllm_kl", "vllm_gap"):
                figures[key] += float(out[key])
            figures["vllm_gap_max"] = max(figures["vllm_gap_max"], out["vllm_gap_max"])
            if kl is not None:
                figures["kl"] += float((kl.detach() * mask).sum())
            tokens += int(mask.sum())
            if self.replay is not None and self.sequence is None:  # the tokens a route could be replayed at
                real = sum(sample_length(s) for s in micro if s is not EMPTY_SAMPLE)
                figures["routes_tokens"] += len(self.replay.hooks) * real
        lr, grad_norm = self._optimizer_step()
        figures["routes_known"], figures["routes_differ"] = self.routing_counts()
        return {**figures, "tokens": tokens, "grad_norm": grad_norm, "lr": lr}

    @torch.no_grad()
    def logprobs(self, micro_batches: list, temperature: float, layout: dict, reference: bool = False,
                 top_p: float = 1.0) -> list:
        """Each sample's log-probs at its response positions (observations too) under the current weights, or the
        reference model's; per micro batch, a list per sample. Every rank runs as many micro batches (ZeRO-3).
        top_p < 1: of the nucleus distribution (the policy's the rollout sampled from; the reference's its own)."""
        model = self.reference if reference and not self.lora else self.engine
        adapter_off = self.engine.module.disable_adapter() if reference and self.lora else contextlib.nullcontext()
        with self.timeline.span("train"), adapter_off:
            model.eval()
            out = []
            for micro in micro_batches:
                logp, _ = self._logprobs(model, micro or [EMPTY_SAMPLE], temperature, layout, top_p=top_p)
                out.append([logp[i, len(s["prompt_ids"]) - 1 : sample_length(s) - 1].tolist()
                            for i, s in enumerate(micro)])
            return out

    @torch.no_grad()
    def forward_logprobs(self, samples: list, temperature: float = 1.0, adapter: bool = True) -> list:
        """Per-response-token logprobs and greedy (argmax) tokens under the current weights (adapter False: with the
        LoRA adapter disabled), from padded rows and whole logits (the reference the other layouts are checked
        against, and the trainer's side of the weight sync's probe). Under ZeRO-3 every rank must call this with the
        same samples (parameters are gathered collectively)."""
        self.engine.eval()
        if self.replay is not None:  # the model's own routing: these are the trainer's reference log-probs
            self.replay.set(None)
        inputs = Layout.of(samples, packed=False).to(self._device())
        off = self.engine.module.disable_adapter() if self.lora and not adapter else contextlib.nullcontext()
        with off:
            logits = self.engine(input_ids=inputs.ids, attention_mask=inputs.attention_mask).logits[:, :-1]
        logp = token_logprobs(logits, inputs.ids[:, 1:], temperature)
        greedy = logits.argmax(-1)
        mask = self._targets(samples)["mask"]
        out = []
        for i in range(len(samples)):
            pos = mask[i].bool()
            out.append({"logprobs": logp[i][pos].tolist(), "greedy_ids": greedy[i][pos].tolist()})
        return out

    def routing_counts(self) -> tuple:
        """A mixture of experts': (tokens with the rollout's routes, of them routed apart by the trainer) over the
        forward passes since the last call (routing_replay.RoutingReplay); the last pass's routes forgotten (its
        backward is done: no later forward may replay them)."""
        if self.replay is None:
            return 0, 0
        self.replay.set(None)
        return self.replay.take_counts()

    def read_parameter(self, name: str) -> torch.Tensor:
        """A parameter of the trained module by its own name (with LoRA: peft's, e.g. ...lora_B.default.weight)."""
        import deepspeed

        param = dict(self.engine.module.named_parameters())[name]
        with deepspeed.zero.GatheredParameters([param], enabled=self.zero_stage == 3):
            return param.data.detach().float().cpu().clone()

    def save_hf(self, path: str, merged: bool = False) -> None:
        """Save an HF-format checkpoint (config, full weights, tokenizer) from rank 0. With LoRA: the adapter in
        peft's format (adapter_config.json naming the base, adapter_model.safetensors) and the tokenizer; merged:
        also the merged model in path/merged."""
        import deepspeed
        from transformers import AutoTokenizer

        model = self.engine.module
        state = {}
        for name, param in model.named_parameters():
            if self.lora and not param.requires_grad:
                continue
            with deepspeed.zero.GatheredParameters([param], enabled=self.zero_stage == 3):
                if self.rank == 0:
                    state[name] = param.data.detach().cpu().clone()
        if self.rank == 0:
            model.save_pretrained(path, state_dict=state)
            AutoTokenizer.from_pretrained(self.model_path).save_pretrained(path)
        if self.lora and merged:
            self._save_merged(os.path.join(path, "merged"))

    def _save_merged(self, path: str) -> None:
        """The merged model (the weights the engines load) in HF format, from rank 0."""
        from transformers import AutoTokenizer

        whole = {}
        for name, *_ in self.weights.sources:
            with self.weights.gathered([name]) as values:
                if self.rank == 0:
                    whole[name] = values()[0].detach().cpu().clone()
        if self.rank == 0:
            self.engine.module.get_base_model().save_pretrained(path, state_dict=whole)
            AutoTokenizer.from_pretrained(self.model_path).save_pretrained(path)

    # ---- the weights the engines load (weight_export.py), called by trainer/weight_sync.py and trainer/hybrid.py ----

    def probe_ids(self) -> list:
        return probe_ids(self.model_path)

    def named_shapes(self) -> list:
        return self.weights.named_shapes()

    def read_weight(self, name: str) -> torch.Tensor:
        return self.weights.read_weight(name)

    def weight_sync_address(self) -> tuple:
        return self.weights.weight_sync_address()

    def init_weight_sync_group(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        self.weights.init_weight_sync_group(host, port, world_size, backend, timeout_s)

    def broadcast_weights(self, buckets: list, track: bool = False) -> bool:
        return self.weights.broadcast_weights(buckets, track)

    def broadcast_patches(self, buckets: list) -> bool:
        return self.weights.broadcast_patches(buckets)

    def begin_sync(self) -> None:
        self.weights.begin_sync()

    def weights_fingerprint(self, values: bool = False) -> dict:
        return self.weights.weights_fingerprint(values)

    def sync_figures(self) -> tuple:
        return self.weights.sync_figures()

    def open_weight_file(self, size: int) -> str:
        return self.weights.open_weight_file(size)

    def unlink_weight_file(self) -> None:
        self.weights.unlink_weight_file()

    def write_bucket(self, bucket: list) -> bool:
        return self.weights.write_bucket(bucket)

    def share_bucket(self, bucket: list, owner: bool):
        return self.weights.share_bucket(bucket, owner)

    def release_shared(self) -> None:
        self.weights.release_shared()
