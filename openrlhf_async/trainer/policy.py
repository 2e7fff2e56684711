"""The policy: one Ray actor per DeepSpeed rank (any ZeRO stage, 2 by default as in OpenRLHF), trained with the
DAPO/GRPO loss and an off-policy correction against the rollout logprobs; optionally a frozen reference model for a KL
penalty, in a DeepSpeed config of its own (frozen_model_config).

Rank 0 also owns the sender side of the weight-sync group into the vLLM engines."""

import contextlib
import math
import os

import torch

from openrlhf_async.trainer.batching import Layout, plan, sample_length, target_logprobs
from openrlhf_async.trainer.losses import (
    aggregate,
    approx_kl,
    kl_reward_advantages,
    policy_loss,
    token_logprobs,
)
from openrlhf_async.utils.ports import free_port
from openrlhf_async.utils.ray_utils import get_all
from openrlhf_async.utils.timeline import Timeline

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The probe a weight sync checks the engines with: the engines' greedy continuation of each, scored by the trainer.
PROBE_TEXTS = ("The capital of France is", "12 + 30 =")


def _node_address() -> tuple:
    """(node id, IP, a free port) of the node this runs on."""
    import ray

    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), free_port()


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
    """The DeepSpeed config of the policy from the --ds.* settings."""
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


def weight_sources(module, lora: bool) -> list:
    """What the engines load, in the module's order: (the name vLLM knows, the parameters its value is made of, the
    adapter's scaling). Without LoRA, each parameter as it is. With LoRA, the base model's names, and an adapted
    layer's weight merged: W + scaling x B @ A (computed apart, nothing merged in place: under ZeRO-3 W is a
    partition)."""
    if not lora:
        return [(name, [p], None) for name, p in module.named_parameters()]
    base = module.get_base_model()
    layers = dict(base.named_modules())
    sources = []
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        if name.endswith(".base_layer.weight"):
            layer = layers[name[: -len(".base_layer.weight")]]
            sources.append((name.replace(".base_layer", ""),
                            [p, layer.lora_A["default"].weight, layer.lora_B["default"].weight],
                            layer.scaling["default"]))
        else:
            sources.append((name.replace(".base_layer", ""), [p], None))
    return sources


def source_value(params: list, scaling) -> torch.Tensor:
    """A weight as the engines load it, from its (gathered) parameters (weight_sources)."""
    if scaling is None:
        return params[0].data
    weight, a, b = (t.data for t in params)
    return (weight.float() + (b.float() @ a.float()) * scaling).to(weight.dtype)


def batch_totals(samples: list) -> dict:
    """The batch's response tokens the model wrote and its sequences with any: what the loss is averaged over."""
    masks = [s.get("action_mask", [1] * len(s["response_ids"])) for s in samples]
    return {"tokens": max(1, sum(map(sum, masks))), "sequences": max(1, sum(1 for m in masks if any(m)))}


class PolicyActor:
    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path, *,
                 backend: str, ds: dict, optim: dict, model: dict, seed: int, reference: bool = False):
        """model_path: the model's folder (or hub id), or a transformers config for random weights of its shape;
        ds: deepspeed_config's settings; optim: lr, betas, eps, weight_decay, max_norm, scheduler, warmup_ratio,
        min_lr_ratio, total_steps; model: attn_implementation, experts_implementation, gradient_checkpointing,
        reentrant, deterministic."""
        # LOCAL_RANK 0: Ray gives each rank actor its own GPU as device 0 (CUDA_VISIBLE_DEVICES).
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        import deepspeed
        from transformers import enable_full_determinism, get_scheduler
        from transformers.integrations.deepspeed import HfDeepSpeedConfig

        torch.manual_seed(seed)
        if model["deterministic"]:
            enable_full_determinism(seed)
        if backend == "gloo":
            make_collectives_synchronous()
            # DeepSpeed compiles a shared-memory all-reduce at every CPU start for inference only (training never uses
            # it); a build killed midway leaves torch's lock file behind and every later start waits on it for ever.
            import deepspeed.comm.torch

            deepspeed.comm.torch.build_shm_op = lambda: None
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
        self.lora = bool(ds.get("lora"))
        policy = self._build(model_path, load, model, ds)
        trainable = [p for p in policy.parameters() if p.requires_grad]
        adam = dict(lr=optim["lr"], betas=tuple(optim["betas"]), eps=optim["eps"], weight_decay=optim["weight_decay"])
        if ds["adam_offload"] or (ds.get("enable_sleep") and model["device"] == "cuda"):
            jit_arch_list()
        if ds["adam_offload"]:  # ZeRO-Offload steps the optimizer on the CPU: DeepSpeed's own CPU Adam (AdamW)
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(trainable, adamw_mode=True, **adam)
        elif ds.get("enable_sleep") and self.zero_stage == 3 and model["device"] == "cuda":
            # DeepSpeed offloads ZeRO-3 optimizer states of its FusedAdam only (stage3.offload_states), as OpenRLHF
            # builds it for the hybrid engine.
            from deepspeed.ops.adam import FusedAdam

            optimizer = FusedAdam(trainable, adam_w_mode=True, **adam)
        else:
            optimizer = torch.optim.AdamW(trainable, **adam)
        total = max(1, optim["total_steps"])
        extra = {"min_lr_rate": optim["min_lr_ratio"]} if optim["scheduler"] == "cosine_with_min_lr" else {}
        scheduler = get_scheduler(optim["scheduler"], optimizer, num_warmup_steps=math.ceil(optim["warmup_ratio"] * total),
                                  num_training_steps=total, scheduler_specific_kwargs=extra)
        self.engine, *_ = deepspeed.initialize(model=policy, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=ds_config)
        # With LoRA the reference model is the policy with its adapter disabled: no second copy of the weights.
        self.reference = (self._load_reference(model_path, load, frozen_model_config(ds))
                          if reference and not self.lora else None)
        self.sources = weight_sources(self.engine.module, self.lora)
        self.model_path = model_path
        self.sync_group = None
        self.adam_offload, self.offloaded = ds["adam_offload"], False
        self.weight_file = self.held = None  # the hybrid engine's: shared bucket (cpu) or IPC-shared tensors (cuda)
        self.timeline = Timeline(f"rank {rank}")

    def _build(self, model_path, load: dict, model: dict, ds: dict):
        """The trained model (see model_settings), before DeepSpeed wraps it: the causal LM, with its adapter."""
        policy = _build_model(model_path, load)
        if model["gradient_checkpointing"]:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": model["reentrant"]})
        if self.lora:
            policy = _with_adapter(policy, ds["lora"], model["gradient_checkpointing"])
        return policy

    def _load_reference(self, model_path: str, load: dict, ds_config: dict):
        """The initial policy, frozen, in a DeepSpeed engine of its own config (frozen_model_config)."""
        import deepspeed
        from transformers import AutoModelForCausalLM
        from transformers.integrations.deepspeed import HfDeepSpeedConfig, set_hf_deepspeed_config

        # Under ZeRO-3 from_pretrained partitions the weights by the one config transformers holds (the last one
        # made): the reference's for this load (its parameter offload), then the policy's again.
        hf_ds_config = HfDeepSpeedConfig(ds_config) if self.zero_stage == 3 else None
        model = AutoModelForCausalLM.from_pretrained(model_path, **load)
        if hf_ds_config is not None:
            set_hf_deepspeed_config(self._hf_ds_config)
        engine, *_ = deepspeed.initialize(model=model.eval().requires_grad_(False), config=ds_config)
        return engine

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

    def _logprobs(self, model, samples: list, temperature: float, layout: dict, entropy: bool = False):
        """[B, T] log-probs (and entropies) of one forward pass over samples, laid out as layout says (packing,
        chunk: see batching_settings)."""
        inputs = Layout.of(samples, layout["packing"]).to(self._device())
        return target_logprobs(model, inputs, temperature, layout["chunk"], entropy)

    def train_step(self, micro_batches: list, totals: dict, loss_cfg: dict, layout: dict) -> dict:
        """One optimizer step over this rank's micro batches (lists of samples; an empty one stands in where the
        rank has none left: every rank runs as many, as ZeRO-3 gathers parameters collectively per forward). The
        loss is aggregated over the global batch (totals: its response tokens and sequences). loss_cfg: see
        loss_settings; layout: see batching_settings."""
        with self.timeline.span("train"):
            return self._train_step(micro_batches, totals, loss_cfg, layout)

    def _train_step(self, micro_batches: list, totals: dict, loss_cfg: dict, layout: dict) -> dict:
        self.engine.train()
        figures = dict.fromkeys(["loss", "clipped", "corrected", "weight", "vllm_kl", "kl", "entropy"], 0.0)
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
                                           entropy=loss_cfg["entropy_coef"] is not None)
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
        # At ZeRO stage 0 with fp32 weights DeepSpeed clips the plain optimizer's gradients without keeping their
        # norm: it is measured here, on the gradients each rank holds averaged over all ranks.
        plain_norm = self._grad_norm() if self.zero_stage == 0 else None
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        grad_norm = plain_norm if grad_norm is None else grad_norm
        return {**figures, "tokens": tokens, "grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
                "lr": lr}

    @torch.no_grad()
    def _grad_norm(self):
        norms = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.stack(norms).norm()) if norms else None

    @torch.no_grad()
    def logprobs(self, micro_batches: list, temperature: float, layout: dict, reference: bool = False) -> list:
        """Each sample's log-probs at its response positions (observations too) under the current weights, or the
        reference model's; per micro batch, a list per sample. Every rank runs as many micro batches (ZeRO-3)."""
        model = self.reference if reference and not self.lora else self.engine
        adapter_off = self.engine.module.disable_adapter() if reference and self.lora else contextlib.nullcontext()
        with self.timeline.span("train"), adapter_off:
            model.eval()
            out = []
            for micro in micro_batches:
                logp, _ = self._logprobs(model, micro or [EMPTY_SAMPLE], temperature, layout)
                out.append([logp[i, len(s["prompt_ids"]) - 1 : sample_length(s) - 1].tolist()
                            for i, s in enumerate(micro)])
            return out

    @torch.no_grad()
    def forward_logprobs(self, samples: list, temperature: float = 1.0, adapter: bool = True) -> list:
        """Per-response-token logprobs and greedy (argmax) tokens under the current weights (adapter False: with the
        LoRA adapter disabled), from padded rows and whole logits (the reference the other layouts are checked
        against). Under ZeRO-3 every rank must call this with the same samples (parameters are gathered
        collectively)."""
        self.engine.eval()
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

    # ---- weight sync -------------------------------------------------------------------------------------------

    def weight_sync_address(self) -> tuple:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def named_shapes(self) -> list:
        """[(name, dtype, shape)] of what the engines load (weight_sources), in order."""
        return [(name, str(params[0].dtype).replace("torch.", ""), tuple(getattr(params[0], "ds_shape", params[0].shape)))
                for name, params, _ in self.sources]

    @contextlib.contextmanager
    def _gathered(self, names: list):
        """The named weights' sources gathered (a collective over the ZeRO-3 ranks: every rank enters with the same
        names); yields a function returning their values as the engines load them."""
        import deepspeed

        by_name = {name: (params, scaling) for name, params, scaling in self.sources}
        chosen = [by_name[n] for n in names]
        with deepspeed.zero.GatheredParameters([p for params, _ in chosen for p in params],
                                               enabled=self.zero_stage == 3):
            yield lambda: [source_value(params, scaling) for params, scaling in chosen]

    def probe_ids(self) -> list:
        """The token ids of the fixed probe text the weight sync checks the engines with (trainer/weight_sync.py)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return [tokenizer(text)["input_ids"] for text in PROBE_TEXTS]

    def init_weight_sync_group(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        if self.rank != 0:
            return
        from openrlhf_async.rollout.sync_group import SyncGroup

        if self.sync_group is not None:  # a group of earlier members
            self.sync_group.close()
            self.sync_group = None
        self.sync_group = SyncGroup(host, port, 0, world_size, backend, timeout_s, self._device())

    def broadcast_weights(self, buckets: list) -> bool:
        """Gather each bucket's parameters (collective over the ZeRO-3 ranks) and broadcast them from rank 0.
        Returns whether every broadcast completed (not merely started: NCCL's wait does not block): when one fails
        (an engine died or hangs), rank 0 stops broadcasting but keeps gathering with the other ranks, so the
        trainer's own collectives stay in step, and the group is aborted."""
        ok = True
        with self.timeline.span("sync"):
            for bucket in buckets:
                with self._gathered([name for name, _, _ in bucket]) as values:
                    if self.rank == 0 and ok:
                        flat = torch.cat([t.reshape(-1) for t in values()])
                        ok = self._sync_step(self.sync_group.broadcast, flat)
            if self.rank == 0 and ok:
                ok = self._sync_step(self.sync_group.complete)
        return ok

    @staticmethod
    def _sync_step(step, *args) -> bool:
        try:
            step(*args)
            return True
        except Exception as e:  # the group is aborted: the trainer drops its bad members and forms it again
            print(f"weight broadcast failed: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
            return False

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

    def open_weight_file(self, size: int) -> str:
        """A shared-memory file of size bytes that this rank writes a bucket at a time and the engine on its devices
        maps (the hybrid engine on cpu); its path."""
        import tempfile

        self.unlink_weight_file()
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="openrlhf_async-weights-", dir=folder)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        self.weight_file = (path, torch.from_file(path, shared=True, size=size, dtype=torch.uint8))
        return path

    def unlink_weight_file(self) -> None:
        """Remove the file's name once its engine mapped it: the mappings stay, nothing is left behind."""
        if self.weight_file is not None and self.weight_file[0]:
            try:
                os.unlink(self.weight_file[0])
            except OSError:
                pass
            self.weight_file = ("", self.weight_file[1])

    def write_bucket(self, bucket: list) -> bool:
        """Gather one bucket's parameters (collective over the ZeRO-3 ranks) and, on a rank with a weight file, write
        them there flat, for its engine's update_weights."""
        with self.timeline.span("sync"), self._gathered([name for name, _, _ in bucket]) as values:
            if self.weight_file is not None:
                flat = self.weight_file[1]
                offset = 0
                for t in values():
                    data = t.reshape(-1)
                    size = data.numel() * data.element_size()
                    flat[offset : offset + size].view(data.dtype).copy_(data)
                    offset += size
        return True

    def share_bucket(self, bucket: list, owner: bool):
        """cuda: gather one bucket's parameters and, on a rank with an engine on its GPU, copy them into tensors kept
        until release_shared, exported as CUDA IPC handles: per parameter {this GPU's UUID: rebuild args}, the form of
        vLLM's IPC weight-transfer engine. Not run here (no GPU in this project's CI)."""
        from torch.multiprocessing.reductions import reduce_tensor

        handles = None
        with self.timeline.span("sync"), self._gathered([name for name, _, _ in bucket]) as values:
            if owner:
                uuid = str(torch.cuda.get_device_properties(self._device()).uuid)
                kept = [t.detach().clone() for t in values()]
                self.held = (self.held or []) + kept  # the engine reads them until its finish_weight_update
                handles = [{uuid: reduce_tensor(t)[1]} for t in kept]
        return handles

    def release_shared(self) -> None:
        self.held = None
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()

    def read_weight(self, name: str) -> torch.Tensor:
        """A weight as the engines load it (with LoRA: the base's name, merged), gathered: a collective."""
        with self._gathered([name]) as values:
            return values()[0].detach().float().cpu().clone()

    def read_parameter(self, name: str) -> torch.Tensor:
        """A parameter of the trained module by its own name (with LoRA: peft's, e.g. ...lora_B.default.weight)."""
        import deepspeed

        param = dict(self.engine.module.named_parameters())[name]
        with deepspeed.zero.GatheredParameters([param], enabled=self.zero_stage == 3):
            return param.data.detach().float().cpu().clone()

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
            whole = {}
            for name, _, _ in self.sources:
                with self._gathered([name]) as values:
                    if self.rank == 0:
                        whole[name] = values()[0].detach().cpu().clone()
            if self.rank == 0:
                model.get_base_model().save_pretrained(os.path.join(path, "merged"), state_dict=whole)
                AutoTokenizer.from_pretrained(self.model_path).save_pretrained(os.path.join(path, "merged"))


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


class PolicyGroup:
    """The DeepSpeed ranks as Ray actors, with fan-out helpers the trainer loop calls."""

    actor_class = PolicyActor

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
        self.critic = None  # PPO's critic (trainer/critic.py), trained, saved and restarted with the policy

    @staticmethod
    def world_size(cfg) -> int:
        return cfg.actor.world_size

    @staticmethod
    def keeps_group(cfg) -> bool:
        """Other models share the ranks' bundles (each rank then takes a share of its GPU)."""
        return cfg.hybrid or "policy" in cfg.placement.values()

    @staticmethod
    def settings(cfg) -> dict:
        """Each rank's keyword arguments (PolicyActor)."""
        return dict(backend=cfg.backend, ds=ds_settings(cfg), seed=cfg.train.seed,
                    reference=cfg.algo.kl_init_coef > 0, optim=optimizer_settings(cfg), model=model_settings(cfg))

    def shutdown(self) -> None:
        """Kill the ranks and free their placement (a trainer that restarts after a rank died), the critic's too."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.critic is not None:
            self.critic.shutdown()

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if self.owns_group:
            remove_placement_group(self.group)

    def _plan(self, samples: list, size: int, max_tokens) -> tuple:
        """Per rank, its micro batches as lists of samples, and as lists of their indices (batching.plan)."""
        indices = plan(samples, len(self.actors), size, max_tokens, self.batching["packing"])
        return [[[samples[i] for i in batch] for batch in batches] for batches in indices], indices

    def logprobs(self, samples: list, temperature: float, reference: bool = False) -> list:
        """Each sample's log-probs at its response positions under the current weights (or the reference model's),
        in passes of --rollout.micro_batch_size samples or --rollout.max_tokens_per_gpu tokens."""
        return self._per_sample(samples, "logprobs", temperature, self.batching, reference)

    def _per_sample(self, samples: list, method: str, *args) -> list:
        """Each sample's list from the ranks' `method(micro_batches, *args)` (one list per sample per micro batch),
        run in the log-prob passes' micro batches (--rollout.micro_batch_size or --rollout.max_tokens_per_gpu)."""
        b = self.batching
        batches, indices = self._plan(samples, b["logprobs_micro_batch_size"], b["logprobs_max_tokens"])
        results = get_all([getattr(a, method).remote(micro, *args) for a, micro in zip(self.actors, batches)])
        out = [None] * len(samples)
        for rank_indices, rank_results in zip(indices, results):
            for batch, values in zip(rank_indices, rank_results):
                for i, v in zip(batch, values):
                    out[i] = v
        return out

    def _with_reference(self, samples: list, loss_cfg: dict) -> list:
        """The samples with the reference model's log-probs, computed before the updates as OpenRLHF's experience
        maker does (a pass per training micro batch would run a different number of ZeRO-3 gathers per rank)."""
        if loss_cfg["kl"]["coef"] <= 0 or all("ref_logprobs" in s for s in samples):
            return samples
        refs = self.logprobs(samples, loss_cfg["temperature"], reference=True)
        return [{**s, "ref_logprobs": ref} for s, ref in zip(samples, refs)]

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
        per_epoch = -(-len(samples) // mini_batch_size)
        updates = epochs * per_epoch
        samples = self._with_reference(samples, loss_cfg)
        if loss_cfg["proximal"] == "rollout":
            samples = [{**s, "old_logprobs": s["logprobs"]} for s in samples]
        elif updates > 1 and not all("old_logprobs" in s for s in samples):  # gae's come with them
            olds = self.logprobs(samples, loss_cfg["temperature"])
            samples = [{**s, "old_logprobs": old} for s, old in zip(samples, olds)]
        results = self._updates(samples, micro_batch_size, loss_cfg, mini_batch_size, epochs, seed)
        figures = {key: sum(r[key] for r in results) / len(results) for key in results[0] if key != "tokens"}
        return {**figures, "grad_norm": results[-1]["grad_norm"], "tokens": sum(r["tokens"] for r in results),
                "updates": len(results)}

    def _updates(self, samples: list, micro_batch_size: int, loss_cfg: dict, mini_batch_size: int, epochs: int,
                 seed: int) -> list:
        """train_step's figures of each update: `epochs` passes over the samples in mini batches, shuffled by seed
        (the same for the policy and the critic) unless there is only one."""
        import random

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
        """One optimizer step on the batch, in micro batches of micro_batch_size samples or, with
        --train.dynamic_batch_enable, of --train.max_tokens_per_gpu tokens; returns the step's loss figures (means
        over the batch's tokens)."""
        samples = self._with_reference(samples, loss_cfg)
        totals = batch_totals(samples)
        batches, _ = self._plan(samples, micro_batch_size, self.batching["max_tokens"])
        results = get_all([a.train_step.remote(micro, totals, loss_cfg, self.batching)
                           for a, micro in zip(self.actors, batches)])
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
            "adam_offload": d.adam_offload, "grad_accum_dtype": d.grad_accum_dtype, "ref_offload": cfg.ref.offload,
            "enable_sleep": d.enable_sleep and cfg.hybrid,
            "lora": {"rank": d.lora_rank, "alpha": d.lora_alpha, "dropout": d.lora_dropout,
                     "target_modules": d.lora_target_modules} if d.lora_rank else None}


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
        "entropy_coef": a.entropy_coef, "temperature": cfg.rollout.temperature,
        "correction": {"level": algo.is_correction_level, "mode": algo.is_correction_mode,
                       "gating": algo.is_correction_gating, "threshold": tuple(algo.is_correction_threshold)},
        "kl": {"coef": algo.kl_init_coef, "use_loss": algo.kl_use_loss, "estimator": algo.kl_estimator,
               "unbiased_gradient": algo.kl_unbiased_gradient},
    }
    settings.update(overrides)
    return settings
