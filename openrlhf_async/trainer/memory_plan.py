"""Peak device memory of a trainer rank and of a vLLM engine, estimated from the model's shape and the run's
settings before anything starts: printed by --dry_run, and a run that cannot fit is refused with the flags that
would make it fit.

A trainer rank holds its ZeRO share of the model states (Adam: an fp32 master copy and two fp32 moments, 12 bytes a
parameter), the frozen reference model where a KL term loads one, and the activations of its largest micro batch.
A vLLM engine takes --vllm.gpu_memory_utilization of each of its GPUs, whose weights (split by tensor parallelism)
must fit inside that share. In the hybrid engine an engine and a rank share each device, and the plan checks the peak
of the step's three phases (trainer/hybrid.py): generation (the engine awake beside what the rank keeps), training
(the rank's peak beside what a sleeping engine keeps) and the weight transfer (the engine's weights, what the rank
keeps, and the model's copies it exports), each with both processes' CUDA contexts; the blocks the engine's
reload leaves in its allocator count in the transfer and the generation after it (reload_cache_bytes). GB here are
2^30 bytes, as torch and nvidia-smi count them."""

import dataclasses
import functools
import os
from dataclasses import dataclass

from openrlhf_async.errors import ConfigError
from openrlhf_async.utils.model_info import check_sizes

GB = 2**30
REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size, in elements (not set in deepspeed_config)
# Outside torch's allocator, so outside the rank's and the engine's figures, what a process on a GPU holds however it
# sleeps: its CUDA context with the kernels loaded and cuBLAS's and NCCL's workspaces (0.3-0.6 GiB per process in
# published measurements of CUDA 12-13 with lazy loading); and a vLLM engine's CUDA-graph pool, which sleep level 1
# does not release (only its weights' and KV cache's pools), under 1 GiB for the batch sizes vLLM captures. Counted
# in the hybrid engine's phases, where two processes share each device; `make gpu-e2e` measures them on a GPU.
PROCESS_RESIDUAL = GB // 2
CUDA_GRAPH_POOL = GB


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    # A mixture of experts (Qwen2-MoE, Qwen3-MoE): experts per layer (0: a dense MLP), routed per token, each an MLP
    # of expert_size; the layers with a dense MLP instead (mlp_only_layers); Qwen2-MoE's shared expert's size.
    experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    dense_layers: int = 0
    shared_expert_size: int = 0

    @classmethod
    def from_config(cls, c: dict, where: str = "config.json") -> "ModelShape":
        """From an HF config.json's fields (Llama, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE and models shaped like them),
        each size checked (model_info.check_sizes); ConfigError naming where and the field otherwise."""
        check_sizes(c, where)
        heads, layers = c["num_attention_heads"], c["num_hidden_layers"]
        experts = c.get("num_experts") or c.get("num_local_experts") or 0
        step = c.get("decoder_sparse_step") or 1
        # Dense: the layers i with (i + 1) % step != 0, and those of mlp_only_layers that are not (counted, no loop).
        mlp_only = {i for i in c.get("mlp_only_layers") or [] if isinstance(i, int) and 0 <= i < layers}
        dense = layers - layers // step + len({i for i in mlp_only if (i + 1) % step == 0})
        return cls(hidden=c["hidden_size"], layers=layers, heads=heads,
                   kv_heads=c.get("num_key_value_heads") or heads,
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads, intermediate=c["intermediate_size"],
                   vocab=c["vocab_size"], tied=bool(c.get("tie_word_embeddings", False)),
                   # Qwen2 always has q/k/v biases and no config field saying so; Qwen3 normalises q and k per head.
                   qkv_bias=bool(c.get("attention_bias", c.get("model_type") in ("qwen2", "qwen2_moe"))),
                   qk_norm=c.get("model_type") in ("qwen3", "qwen3_moe"),
                   experts=experts, experts_per_token=c.get("num_experts_per_tok", 0) if experts else 0,
                   expert_size=c.get("moe_intermediate_size", 0) if experts else 0,
                   dense_layers=dense if experts else 0,
                   shared_expert_size=c.get("shared_expert_intermediate_size", 0) if experts else 0)

    def _layer_params(self, active: bool) -> float:
        """A decoder layer's parameters (on average over the layers, dense and MoE); active: those one token runs
        through (its experts_per_token experts, not all of them)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden + (q + 2 * kv) * self.qkv_bias
        mlp = 3 * self.hidden * self.intermediate
        if self.experts:
            routed = (self.experts_per_token if active else self.experts) * 3 * self.hidden * self.expert_size
            shared = (3 * self.hidden * self.shared_expert_size + self.hidden) if self.shared_expert_size else 0
            moe = routed + self.experts * self.hidden + shared  # + the router
            mlp = (self.dense_layers * mlp + (self.layers - self.dense_layers) * moe) / self.layers
        return attention + mlp + 2 * self.hidden + 2 * self.head_dim * self.qk_norm

    @property
    def layer_params(self) -> int:
        """The largest layer's parameters (what ZeRO-3 gathers at once): every expert of a MoE layer."""
        if self.experts and self.dense_layers < self.layers:
            return int(dataclasses.replace(self, dense_layers=0)._layer_params(False))
        return int(self._layer_params(False))

    @property
    def largest_module_params(self) -> int:
        """The parameters of the largest of vLLM's modules (a module's own, not its children's): the unit vLLM's
        layerwise reload materialises at once (model_loader/reload/layerwise.py, _layerwise_process). The embedding
        or head (its vocabulary padded to 64, as VocabParallelEmbedding does), q/k/v packed in qkv_proj, o_proj, gate
        and up packed in gate_up_proj, down_proj, and in a mixture of experts the fused-experts module that holds
        every expert's w13 and w2, the shared expert's gate_up_proj and the router."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        sizes = [-(-self.vocab // 64) * 64 * self.hidden, self.hidden * (q + 2 * kv) + (q + 2 * kv) * self.qkv_bias,
                 q * self.hidden]
        if not self.experts or self.dense_layers:
            sizes += [2 * self.hidden * self.intermediate]
        if self.experts:
            sizes += [3 * self.experts * self.hidden * self.expert_size, 2 * self.hidden * self.shared_expert_size,
                      self.experts * self.hidden]
        return int(max(sizes))

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width one token runs through: the dense MLP's, or its experts' and the shared one's."""
        if not self.experts:
            return self.intermediate
        return max(self.intermediate if self.dense_layers else 0,
                   self.experts_per_token * self.expert_size + self.shared_expert_size)

    def lora_params(self, rank: int, targets) -> int:
        """The adapter's parameters: rank x (in + out) per adapted linear layer (all-linear: every linear layer of
        the decoder; else those named)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        linear = {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
                  "o_proj": (q, self.hidden), "gate_proj": (self.hidden, self.intermediate),
                  "up_proj": (self.hidden, self.intermediate), "down_proj": (self.intermediate, self.hidden)}
        names = linear if targets == "all-linear" else [t for t in targets if t in linear]
        return self.layers * sum(rank * sum(linear[n]) for n in names)

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return int(self.layers * self._layer_params(False)) + embeddings + self.hidden

    @property
    def active_params(self) -> int:
        """The parameters one token runs through: all of a dense model, a mixture of experts' routed ones only."""
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return int(self.layers * self._layer_params(True)) + embeddings + self.hidden


@dataclass(frozen=True)
class Setup:
    """What the plan reads from the run's config (setup_of); the remedies are changed copies of it."""
    ranks: int
    zero_stage: int
    dtype_bytes: int
    adam_offload: bool
    reference: bool
    ref_offload: bool
    checkpointing: bool
    train_tokens: int  # of the largest training micro batch
    logprob_tokens: int  # of the largest micro batch of a pass that only computes log-probs
    chunk: int  # --actor.logprobs_chunk_size; 0: all positions' logits at once
    longest: int  # --data.max_len
    packed: bool
    masked: bool  # sdpa attention, which takes a [T, T] mask for packed samples or padded rows
    tensor_parallel: int
    gpu_memory_utilization: float
    cpu_kvcache_gb: float
    device: str
    hybrid: bool = False  # an engine shares each rank's device (--train.colocate_all in sync mode)
    engine_sleep: bool = False  # --vllm.enable_sleep: the engine's weights and KV cache leave the device to train
    cuda_graphs: bool = True  # not --vllm.enforce_eager: vLLM keeps a CUDA-graph pool
    trainer_sleep: bool = False  # --ds.enable_sleep: the rank's gradients and optimizer leave it to generate
    lora_rank: int = 0  # --ds.lora.rank: the adapter alone has gradients and optimizer states; no second model
    lora_targets: object = "all-linear"
    # Models colocated on each rank's device (--train.colocate_all): the critic rank's states and the reward models'
    # weights while training; what of them stays on the device while the engines generate (the hybrid engine).
    colocated_train: int = 0
    colocated_kept: int = 0
    bucket_bytes: int = 64 << 20  # --train.weight_sync_bucket_mb
    top_p: float = 1.0  # --rollout.top_p: the policy's log-probs are of the nucleus distribution
    sparse_sync: bool = False  # sparse weight syncs: each rank keeps its part of the weights of the last sync
    sequence_parallel: int = 1  # --ds.ring_attn_size: ranks sharing each packed row (train_tokens: this rank's share)


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def setup_of(cfg) -> Setup:
    """The largest micro batch: a token budget (a longer sample alone makes one) or micro_batch_size padded rows."""
    from openrlhf_async.config import attn_implementation

    t, r, longest, n = cfg.train, cfg.rollout, cfg.data.max_len, cfg.ds.ring_attn_size
    # A rank's share of its group's largest row (--ds.ring_attn_size; the budgets are per GPU): a sample longer than
    # the budgets makes a micro batch alone, split n ways like any other.
    share = -(-longest // n)
    train = max(t.max_tokens_per_gpu, share) if t.dynamic_batch_enable else -(-t.micro_batch_size * longest // n)
    logprob = (max(r.max_tokens_per_gpu or 0, share) if t.dynamic_batch_enable
               else -(-r.micro_batch_size * longest // n))
    return Setup(ranks=cfg.actor.world_size, zero_stage=cfg.ds.zero_stage, dtype_bytes=DTYPE_BYTES[cfg.dtype],
                 adam_offload=cfg.ds.adam_offload, reference=cfg.algo.kl_init_coef > 0, ref_offload=cfg.ref.offload,
                 checkpointing=cfg.actor.gradient_checkpointing_enable, train_tokens=train, logprob_tokens=logprob,
                 chunk=cfg.actor.logprobs_chunk_size, longest=longest, packed=cfg.ds.packing_samples,
                 masked=attn_implementation(cfg.ds.attn_implementation, cfg.device) == "sdpa",
                 tensor_parallel=cfg.vllm.tensor_parallel_size,
                 gpu_memory_utilization=cfg.vllm.gpu_memory_utilization,
                 cpu_kvcache_gb=cfg.vllm.cpu_kvcache_space_gib, device=cfg.device, hybrid=cfg.hybrid,
                 engine_sleep=cfg.vllm.enable_sleep, cuda_graphs=not cfg.vllm.enforce_eager,
                 trainer_sleep=cfg.ds.enable_sleep, lora_rank=cfg.ds.lora_rank,
                 lora_targets=cfg.ds.lora_target_modules, bucket_bytes=cfg.train.weight_sync_bucket_mb << 20,
                 top_p=cfg.rollout.top_p, sparse_sync=cfg.sparse_sync, sequence_parallel=n)


def layer_activation_bytes(m: ModelShape, b: int) -> int:
    """Bytes one decoder layer keeps per token for its backward pass (HF Llama/Qwen code, sdpa): the two RMSNorms'
    fp32 input and output, q/k/v before and after the rotary embedding, k/v repeated to every query head (GQA),
    attention output and o_proj input, and the MLP's gate, up, activation and product."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return 2 * (8 * m.hidden + b * m.hidden) + b * (5 * q + 4 * kv + 2 * q + 4 * m.mlp_width)


def logits_bytes(m: ModelShape, positions: int, b: int, backward: bool, nucleus: bool = False) -> int:
    """The vocabulary-wide logits of `positions` positions: as computed (b bytes), in fp32 (a copy when b < 4),
    divided by the temperature and log-softmaxed; the backward pass adds two fp32 gradients of them. nucleus
    (--rollout.top_p < 1): the set is chosen from a sorted copy (fp32), its order (int64) and their cumulative
    probabilities (fp32), and the logits outside it masked (another fp32 copy)."""
    per_logit = b + (4 if b < 4 else 0) + 8 + (8 if backward else 0) + (20 if nucleus else 0)
    return positions * m.vocab * per_logit


def mask_bytes(s: Setup, tokens: int) -> int:
    """sdpa's attention mask: packed samples get a boolean [T, T] one (padded rows an [L, L] one each), which torch
    turns into a float one of the model's dtype; measured on CPU, one of each is live at a time. A row split across
    ranks (sequence parallelism) has none: each of its samples attends causally alone."""
    if not s.masked or s.sequence_parallel > 1:
        return 0
    return (tokens * tokens if s.packed else tokens * s.longest) * (1 + s.dtype_bytes)


def split_heads(m: ModelShape, n: int) -> ModelShape:
    """The heads as a row split n ways attends with them (sequence_parallel._attention): padded to a multiple of n,
    and the key/value heads repeated to the query heads where they do not split n ways. Per token of a rank's share
    the attention then keeps as much as a model of these heads would per token."""
    heads = -(-m.heads // n) * n
    return dataclasses.replace(m, heads=heads, kv_heads=m.kv_heads if m.kv_heads % n == 0 else heads)


def sequence_exchange_bytes(m: ModelShape, s: Setup, tokens: int) -> int:
    """Sequence parallelism's all-to-alls around one layer's attention, per rank: a send and a receive buffer of its
    tokens' queries, keys, values and output (heads as split_heads)."""
    split = split_heads(m, s.sequence_parallel)
    return 2 * tokens * s.dtype_bytes * split.head_dim * (2 * split.heads + 2 * split.kv_heads)


def rank_bytes(m: ModelShape, s: Setup) -> dict:
    """A trainer rank's peak, by part (bytes)."""
    P, N, z, b = m.params, s.ranks, s.zero_stage, s.dtype_bytes
    trained = m.lora_params(s.lora_rank, s.lora_targets) if s.lora_rank else P
    weights = b * (P + trained * bool(s.lora_rank)) / (N if z == 3 else 1)
    P = trained  # what has gradients and optimizer states
    grads = b * P / (N if z >= 2 else 1)
    if z == 0 and b == 4:  # torch's AdamW steps the fp32 weights themselves: two moments
        optimizer = 8 * P
    else:  # a partitioned fp32 master copy (even of fp32 weights: DeepSpeed clones it) and two moments
        optimizer = 12 * P / N
        # Stage 0 in bf16 is DeepSpeed's BF16_Optimizer, which accumulates fp32 gradients beside the bf16 ones.
        grads += 4 * P if z == 0 else 0
    optimizer = 0 if s.adam_offload else optimizer
    buffers = b * min(REDUCE_BUCKET, P) if z >= 1 else 0
    if z == 3:  # gathered parameters in flight: the module being run and the one prefetched
        buffers += 2 * b * max(m.layer_params, m.vocab * m.hidden)
    reference = 0 if not s.reference or s.lora_rank or (z == 3 and s.ref_offload) else b * m.params / (
        N if z == 3 else 1)
    layer = layer_activation_bytes(split_heads(m, s.sequence_parallel), b)  # n = 1: the model's own heads
    T = s.train_tokens
    # Checkpointing keeps each layer's input and recomputes one layer at a time in the backward pass.
    kept = T * m.layers * (b * m.hidden if s.checkpointing else layer)
    activations = kept + T * layer + T * 4 * b * m.hidden  # + one layer's backward working set, embeddings, norm
    if s.sequence_parallel > 1:  # the all-to-alls' send and receive buffers of q, k, v and the output, one layer's
        activations += sequence_exchange_bytes(m, s, T)
    logits = logits_bytes(m, min(s.chunk, T) if s.chunk else T, b, backward=True, nucleus=s.top_p < 1)
    # A log-prob pass keeps no activations: one layer's at a time, and its logits (chunked alike).
    logprob_pass = s.logprob_tokens * b * (4 * m.hidden + 2 * m.mlp_width) + logits_bytes(
        m, min(s.chunk, s.logprob_tokens) if s.chunk else s.logprob_tokens, b, backward=False, nucleus=s.top_p < 1)
    # The sparse sync's baseline: this rank's part (its ZeRO-3 partition, or an equal share) of every weight as the
    # engines hold it, to find what changed (weight_export.WeightExport.broadcast_patches).
    baseline = b * m.params / N if s.sparse_sync else 0
    parts = {"weights": weights, "gradients": grads, "optimizer": optimizer, "buffers": buffers,
             "reference": reference, "sync_baseline": baseline, "activations": activations,
             "attention_mask": mask_bytes(s, T), "logits": logits}
    if s.colocated_train:
        parts["colocated"] = s.colocated_train
    states = weights + grads + optimizer + buffers + reference + baseline + s.colocated_train
    parts["total"] = states + max(activations + parts["attention_mask"] + logits,
                                    logprob_pass + mask_bytes(s, s.logprob_tokens))
    return {k: int(v) for k, v in parts.items()}


def engine_bytes(m: ModelShape, s: Setup, device_bytes) -> dict:
    """One engine's GPU: its weights (split over tensor_parallel GPUs) and the share vLLM takes; on cpu, the
    weights and the KV cache it is given (--vllm.cpu_kvcache_space_gib)."""
    weights = s.dtype_bytes * m.params / s.tensor_parallel
    if s.device == "cpu":  # the weights, and the copy vLLM-CPU packs for its kernels (weight_transfer.keep_cpu_weights)
        return {"weights": int(weights), "packed": int(weights), "total": int(2 * weights + s.cpu_kvcache_gb * GB)}
    share = s.gpu_memory_utilization * device_bytes if device_bytes else None
    return {"weights": int(weights), "total": int(share) if share else None,
            "kv_cache": int(share - weights - graph_pool_bytes(s)) if share else None}


def graph_pool_bytes(s: Setup) -> int:
    """An engine's CUDA-graph pool (none with --vllm.enforce_eager): in its share, and kept while it sleeps."""
    return CUDA_GRAPH_POOL if s.cuda_graphs else 0


def hybrid_bytes(m: ModelShape, rank: dict, engine: dict, s: Setup) -> dict:
    """One device of the hybrid engine, by phase of the step. The rank keeps its weights and the frozen reference
    model throughout; its gradients, optimizer and buffers too unless --ds.enable_sleep offloads them (DeepSpeed's
    offload_states; not under --ds.adam_offload, where they already live on the host). A sleeping engine (level 1)
    keeps its CUDA-graph pool; an engine that does not sleep keeps its whole share. Both processes keep their CUDA
    context (PROCESS_RESIDUAL) in every phase. During the transfer each rank holds the copies it exports by CUDA IPC
    (ipc_copies_bytes), and the engine the blocks its layerwise reload materialised (reload_cache_bytes), which stay
    in its caching allocator through the generation that follows, and for good where it never sleeps."""
    offloaded = s.trainer_sleep and not s.adam_offload
    kept = rank["weights"] + rank["reference"] + s.colocated_kept + (
        0 if offloaded else rank["gradients"] + rank["optimizer"] + rank["buffers"])
    awake = engine["total"] or 0
    asleep = graph_pool_bytes(s)
    contexts = 2 * PROCESS_RESIDUAL
    reloaded = reload_cache_bytes(m, s)
    phases = {"generate": awake + kept + reloaded + contexts,
              "train": rank["total"] + (asleep if s.engine_sleep else awake + reloaded) + contexts,
              "transfer": (engine["weights"] + asleep if s.engine_sleep else awake) + kept + ipc_copies_bytes(m, s)
              + reloaded + contexts}
    return {**phases, "peak": max(phases.values())}


def reload_cache_bytes(m: ModelShape, s: Setup) -> int:
    """What an engine's weight update leaves in its process's caching allocator (vLLM 0.26, read for a GPU and not
    yet measured on one): the layerwise reload turns each module's parameters into meta tensors and, once a module's
    weights have all arrived, materialises them (model_loader/reload/meta.py materialize_layer: torch.empty_strided
    in the device context, outside the sleep allocator's "weights" pool, which only the model's load runs under:
    v1/worker/gpu_worker.py load_model), loads and copies them into the kept parameters and drops them
    (layerwise.py _layerwise_process). One module at a time, so the cache holds about the largest module's shard;
    nothing empties it until the engine's next sleep (device_allocator/cumem.py CuMemAllocator.sleep:
    torch.cuda.empty_cache), so it sits beside the KV cache the engine wakes after the transfer, outside the share
    vLLM sized that cache in."""
    return int(s.dtype_bytes * -(-m.largest_module_params // s.tensor_parallel))


def ipc_copies_bytes(m: ModelShape, s: Setup) -> int:
    """The copies a rank holds while its engine reads them (trainer/hybrid.py): each bucket's is dropped once the
    call that loads it returned, its buckets never split a layer (sync_group.plan_buckets), so two at most (the one
    being read, the one before still being collected), and the embeddings, which vLLM may keep until its finish (a
    padded vocabulary is never seen whole); never more than the whole model."""
    bucket = max(s.bucket_bytes, s.dtype_bytes * m.layer_params)
    embeddings = s.dtype_bytes * m.vocab * m.hidden * (1 if m.tied else 2)
    return min(s.dtype_bytes * m.params, 2 * bucket + embeddings)


def plan(m: ModelShape, s: Setup, device_bytes, checked: bool) -> dict:
    """The rank's and the engine's estimates against the device's memory (in the hybrid engine also the shared
    device's phases); checked: whether a miss refuses the run (see device_memory)."""
    rank, engine = rank_bytes(m, s), engine_bytes(m, s, device_bytes)
    p = {"params": m.params, "active_params": m.active_params, "device_memory": device_bytes, "checked": checked,
         "trainer_rank": rank, "vllm_engine": engine, "setup": dataclasses.asdict(s)}
    if s.hybrid and s.device == "cuda":
        p["hybrid"] = hybrid_bytes(m, rank, engine, s)
    return p


def _fits(m: ModelShape, s: Setup, device_bytes) -> bool:
    return rank_bytes(m, s)["total"] <= device_bytes


def remedies(m: ModelShape, s: Setup, device_bytes, dynamic: bool, longest: int) -> list:
    """The changes that each alone make the rank fit (as flags); else all of them together; else none."""
    options = []
    if not s.checkpointing:
        options.append(("--actor.gradient_checkpointing_enable", {"checkpointing": True}))
    if s.zero_stage < 3:
        options.append(("--ds.zero_stage 3", {"zero_stage": 3}))
    if not s.adam_offload:  # ZeRO-Offload needs a ZeRO optimizer: alone, only from stage 1
        options.append(("--ds.adam_offload", {"adam_offload": True}))
    fitting = [flag for flag, change in options
               if (s.zero_stage or "adam_offload" not in change)
               and _fits(m, dataclasses.replace(s, **change), device_bytes)]
    budget = _largest_budget(m, s, device_bytes, dynamic, longest)
    fitting += [budget] if budget else []
    if fitting or not options:
        return fitting
    together = dataclasses.replace(s, **{k: v for _, change in options for k, v in change.items()})
    return [" ".join(flag for flag, _ in options)] if _fits(m, together, device_bytes) else []


def _largest_budget(m: ModelShape, s: Setup, device_bytes, dynamic: bool, longest: int):
    """The largest token budget (or micro batch size) that fits, as a flag; None if even one sample does not."""
    def fits(tokens):
        return _fits(m, dataclasses.replace(s, train_tokens=tokens), device_bytes)

    if dynamic:
        low, high = longest, s.train_tokens  # a sample longer than the budget is a micro batch alone
        if high <= low or not fits(low):
            return None
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return f"--train.max_tokens_per_gpu {low}"
    size = next((k for k in range(s.train_tokens // longest - 1, 0, -1) if fits(k * longest)), None)
    return size and f"--train.micro_batch_size {size}"


def refusal(p: dict, m: ModelShape, s: Setup, dynamic: bool, longest: int):
    """The one line refusing a plan that does not fit (None when it fits or is not checked)."""
    device = p["device_memory"]
    if not p["checked"] or not device:
        return None
    rank, engine = p["trainer_rank"]["total"], p["vllm_engine"]
    if rank > device:
        fixes = remedies(m, s, device, dynamic, longest)
        fix = (f"try {' / '.join(fixes)}" if fixes else
               "no single setting fits it: add trainer ranks (--actor.num_gpus_per_node) or use a larger device")
        return f"memory plan: trainer rank needs {rank / GB:.1f} GB of {device / GB:.1f} GB; {fix}"
    if engine.get("kv_cache") is not None and engine["kv_cache"] <= 0:
        return (f"memory plan: a vLLM engine's weights need {engine['weights'] / GB:.1f} GB of its "
                f"{engine['total'] / GB:.1f} GB share; raise --vllm.tensor_parallel_size or "
                "--vllm.gpu_memory_utilization")
    shared = p.get("hybrid")
    if shared and shared["peak"] > device:
        phase = max(("generate", "train", "transfer"), key=shared.get)
        fixes = {"generate": "--ds.enable_sleep, or a lower --vllm.gpu_memory_utilization",
                 "train": "--vllm.enable_sleep",
                 "transfer": "a smaller --train.weight_sync_bucket_mb or a larger device (each GPU holds the "
                             "copies its engine reads)"}[phase]
        if phase == "train" and s.engine_sleep:
            fixes = "a lower --vllm.gpu_memory_utilization"
        return (f"memory plan: the hybrid engine's {phase} phase needs {shared['peak'] / GB:.1f} GB of "
                f"{device / GB:.1f} GB on each device (the engine and the trainer rank share it); try {fixes}")
    return None


def table(p: dict) -> str:
    """The plan as a few lines of text."""
    r, e, device = p["trainer_rank"], p["vllm_engine"], p["device_memory"]
    gb = lambda v: "-" if v is None else f"{v / GB:.2f}"  # noqa: E731
    host = p.get("host")
    active = f", {p['active_params'] / 1e9:.3f}B active" if p.get("active_params", p["params"]) < p["params"] else ""
    rows = [f"memory plan ({p['params'] / 1e9:.3f}B parameters{active}; device {gb(device)} GB"
            + ("" if p["checked"] else ", host memory" if host else ", not checked") + ")",
            "  trainer rank: " + ", ".join(f"{k} {gb(v)}" for k, v in r.items() if k != "total")
            + f" -> {gb(r['total'])} GB",
            "  vLLM engine (per GPU): " + ", ".join(f"{k} {gb(v)}" for k, v in e.items() if k != "total")
            + f" -> {gb(e['total'])} GB"]
    if host:
        rows.append(f"  this machine: {_count(host['ranks'], 'trainer rank')} + "
                    f"{_count(host['engines'], 'vLLM engine')} -> {gb(host['total'])} of {gb(host['memory'])} GB")
    if p.get("hybrid"):
        rows.append("  hybrid engine (engine + rank on one device): " + ", ".join(
            f"{k} {gb(v)}" for k, v in p["hybrid"].items() if k != "peak") + f" -> peak {gb(p['hybrid']['peak'])} GB")
    return "\n".join(rows)


@functools.lru_cache(maxsize=8)
def model_shape(model):
    """The shape of --actor.model_name_or_path: an HF folder's config.json, a GGUF file's metadata, a hub id's
    config (from the local cache, else the hub where it answers), or the embedded tiny model's; None where it
    cannot be read (the run then starts unplanned)."""
    from openrlhf_async.utils.model_info import model_config

    try:
        return ModelShape.from_config(model_config(model), f"{model or 'the embedded tiny model'}: config.json")
    except ConfigError:  # a size out of range
        raise
    except (OSError, KeyError, TypeError, ValueError):  # offline hub, a config without the shape's fields
        return None


def device_memory(cfg) -> tuple:
    """(bytes, checked): --plan.device_memory_gb (checked); else a visible GPU's (checked on cuda); else on cpu the
    host's memory, not checked per rank: ranks and engines share it, so for_config checks them together."""
    if cfg.plan.device_memory_gb:
        return int(cfg.plan.device_memory_gb * GB), True
    if cfg.device == "cuda":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory, True
        return None, False  # a driver on a CPU-only head: planned without a device size
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), False


def colocated_bytes(cfg, s: Setup) -> dict:
    """What --train.colocate_all adds to each rank's device (cfg.placement): the critic rank's states (its ZeRO
    partition of weights, gradients, optimizer; its activations come when the policy's are gone) and each reward
    model's whole weights (an actor per model on every device). Shapes that cannot be read count as the actor's."""
    critic = reward = 0
    if cfg.placement["critic"] == "policy":
        rm = [p.strip() for p in (cfg.reward.model_name_or_path or "").split(",") if p.strip()]
        m = model_shape(cfg.critic.model_name_or_path or (rm[0] if rm else cfg.actor.model_name_or_path)) or \
            model_shape(cfg.actor.model_name_or_path)
        part = rank_bytes(m, dataclasses.replace(s, reference=False, lora_rank=0, ranks=cfg.critic.world_size))
        critic = {"train": part["weights"] + part["gradients"] + part["optimizer"] + part["buffers"],
                  "kept": part["weights"] if s.trainer_sleep and not s.adam_offload else None}
        critic["kept"] = critic["train"] if critic["kept"] is None else critic["kept"]
    if cfg.placement["rewards"] == "policy":
        for path in (p.strip() for p in cfg.reward.model_name_or_path.split(",") if p.strip()):
            m = model_shape(path) or model_shape(cfg.actor.model_name_or_path)
            reward += s.dtype_bytes * m.params
    return {"colocated_train": int((critic and critic["train"]) + reward),
            "colocated_kept": int((critic and critic["kept"]) + reward)}


def host_plan(cfg, p: dict):
    """On cpu, a run all on this machine (config.local_cpu_run): its ranks and engines share the host's memory, so
    the plan is checked against it as a whole: {"ranks", "engines", "total"}. None elsewhere (a Ray cluster's nodes
    are not this machine)."""
    from openrlhf_async.config import local_cpu_run

    if not local_cpu_run(cfg):
        return None
    return {"ranks": cfg.actor.world_size, "engines": cfg.num_engines,
            "total": cfg.actor.world_size * p["trainer_rank"]["total"] + cfg.num_engines * p["vllm_engine"]["total"]}


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' * (n != 1)}"


def _largest_part(cfg, p: dict) -> str:
    """The plan's largest part on the host, the flag it comes from and what to do, as words."""
    rank, s, host = p["trainer_rank"], p["setup"], p["host"]
    model = ("the model's size (--actor.model_name_or_path)", "use a smaller model, or a Ray cluster (RAY_ADDRESS)")
    lora = (f"--ds.lora.rank {s['lora_rank']}", "lower it")
    tokens = (f"--train.max_tokens_per_gpu {cfg.train.max_tokens_per_gpu}" if cfg.train.dynamic_batch_enable else
              f"--train.micro_batch_size {cfg.train.micro_batch_size} x --data.max_len {cfg.data.max_len}")
    batch = (tokens, "lower it, or add --actor.gradient_checkpointing_enable")
    adapter = s["lora_rank"] and rank["gradients"] > rank["weights"] / 2  # the adapter outweighs the model
    sources = {"weights": lora if adapter else model,
               "gradients": lora if s["lora_rank"] else model, "optimizer": lora if s["lora_rank"] else model,
               "buffers": model, "reference": (f"--algo.kl.init_coef {cfg.algo.kl_init_coef:g}", "use 0, or LoRA"),
               "activations": batch, "attention_mask": batch,
               "logits": (f"--actor.logprobs_chunk_size {cfg.actor.logprobs_chunk_size}", "lower it"),
               "colocated": ("--train.colocate_all", "drop it")}
    parts = {k: v * host["ranks"] for k, v in rank.items() if k in sources}
    parts["kv_cache"] = host["engines"] * s["cpu_kvcache_gb"] * GB
    sources["kv_cache"] = (f"--vllm.cpu_kvcache_space_gib {s['cpu_kvcache_gb']}", "lower it")
    part = max(parts, key=parts.get)
    flag, fix = sources[part]
    return f"the largest part is the {part.replace('_', ' ')} ({parts[part] / GB:.1f} GB), from {flag}: {fix}"


def for_config(cfg):
    """The run's plan (None where the model's shape cannot be read); raises ConfigError where it cannot fit."""
    shape = model_shape(cfg.actor.model_name_or_path)
    if shape is None:
        return None
    s = setup_of(cfg)
    s = dataclasses.replace(s, **colocated_bytes(cfg, s))
    p = plan(shape, s, *device_memory(cfg))
    # a rank's share of the longest sample: the least a budget can be
    why = refusal(p, shape, s, cfg.train.dynamic_batch_enable, -(-cfg.data.max_len // cfg.ds.ring_attn_size))
    if why:
        raise ConfigError(why)
    host, memory = host_plan(cfg, p), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    p["host"] = host and {**host, "memory": memory}
    if host and host["total"] > memory:  # they cannot all fit: refused now, not swapping or OOM-killed later
        raise ConfigError(f"memory plan: {_count(host['ranks'], 'trainer rank')} x "
                          f"{p['trainer_rank']['total'] / GB:.1f} GB + {_count(host['engines'], 'vLLM engine')} x "
                          f"{p['vllm_engine']['total'] / GB:.1f} GB need "
                          f"{host['total'] / GB:.1f} GB and this machine has {memory / GB:.1f} GB; "
                          + _largest_part(cfg, p))
    return p
