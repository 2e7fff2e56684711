"""This project's weight-transfer engine for vLLM's RL weight-update API (`AsyncLLM.init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update(weight_version)`), registered by name in vLLM's
WeightTransferEngineFactory. It runs inside each vLLM worker: it joins the weight-sync group (sync_group.SyncGroup,
gloo on CPU, NCCL on GPU: the backend is part of its init info) and loads the buckets trainer rank 0 broadcasts
through vLLM's layerwise reload, the path `reload_weights` takes, which works on CPU after start-up where a bare
`model.load_weights` does not.

Why not vLLM's own `nccl` engine on GPU, read again in vLLM 0.32.0 (vllm/distributed/weight_transfer/): its
broadcasts have no time-out (nccl_engine.py:208 and 224, PyNcclCommunicator.broadcast), every update ends in an
unbounded `torch.accelerator.synchronize()` (base.py:502, WeightTransferEngine.update_weights), and its rendezvous
takes the store's default 300 s, which its init info cannot change. 0.32 added
`AsyncLLM.shutdown_weight_transfer_engine` (v1/engine/async_llm.py:1328), which aborts the communicator
(pynccl.py:250-266), but as an RPC to the worker it runs only once a hung broadcast has returned: a dead trainer or
peer still hangs the worker for ever. This engine bounds
each broadcast and checks its completion on both sides (sync_group.SyncGroup), aborts a failed group before another
forms, and is the same on every vLLM this project runs on (0.26 to 0.32: rollout/vllm_compat.py). The hybrid engine
on cuda takes CUDA IPC handles through it too ("ipc"), in the form of vLLM's own `ipc` engine, whose module imports
Ray in 0.26 (ipc_engine.py:11), which a single engine on a GPU machine need not have."""

import math
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from openrlhf_async.rollout.sync_group import (
    DTYPES,
    SyncGroup,
    plan_buckets,
    receive_patches,
    synchronize,
    unflatten,
)

NAME = "openrlhf_async"  # the engine's name in vLLM's factory: AsyncEngineArgs(weight_transfer_config={"backend": NAME})


def register() -> None:
    """Register the engine with vLLM's factory in this process (vLLM's worker processes import weight_receiver.py,
    the worker extension, which calls this before the worker builds its weight-transfer engine)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(NAME, BroadcastWeightTransferEngine)


@dataclass
class BroadcastInitInfo(WeightTransferInitInfo):
    """How the weights travel: "broadcast", over the group (rank 0, the trainer, serves the rendezvous); "shm",
    through a shared-memory file the trainer rank on this engine's devices writes a bucket at a time (the hybrid
    engine on cpu); or "ipc", as CUDA IPC handles of the copies the trainer ranks on this engine's GPUs make of each
    bucket (the hybrid engine on cuda)."""

    transport: str = "broadcast"
    master_address: str = ""
    master_port: int = 0
    rank_offset: int = 0  # this engine's first rank in the group (its tensor-parallel workers follow)
    world_size: int = 0
    backend: str = ""  # "gloo", "nccl" or sync_group.GLOO_AS_NCCL
    timeout_s: float = 0.0
    bucket_bytes: int = 0  # the policy is broadcast in buckets of at most this many bytes (sync_group.plan_buckets)
    path: str = ""  # shm: the file, of bucket_bytes bytes


@dataclass
class BroadcastUpdateInfo(WeightTransferUpdateInfo):
    """The parameters of one update, in the trainer's order (the fields of vLLM's NCCL update info)."""

    names: list
    dtype_names: list
    shapes: list
    ipc_handles: list = None  # ipc: per parameter, {GPU UUID: torch's rebuild_cuda_tensor arguments}
    sparse: bool = False  # broadcast: patches of the elements that changed (receive_patches), not whole weights


class BroadcastWeightTransferEngine(WeightTransferEngine[BroadcastInitInfo, BroadcastUpdateInfo]):
    init_info_cls = BroadcastInitInfo
    update_info_cls = BroadcastUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group, self.bucket_bytes = None, None
        self.shared = None  # shm: the trainer's file, mapped as bytes
        self.ipc = False  # the weights come as CUDA IPC handles
        self.reloading = self.patched = False  # this update's kind, known from its first bucket
        self.targets = None  # where patches go directly (_direct_targets), found at an update's first
        self.fault = None  # a fault planted for the next update (plant_fault): the sync check must catch it
        self.probe_columns = {}  # id(parameter) -> columns this update patched (kernel_mismatches probes them)

    def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:
        if self.group is not None:  # a group of earlier members: aborted before another is formed
            self.group.close()
            self.group = None
        self.shared, self.bucket_bytes = None, init_info.bucket_bytes
        self.ipc = init_info.transport == "ipc"
        if self.ipc:
            return
        if init_info.transport == "shm":
            self.shared = torch.from_file(init_info.path, shared=True, size=init_info.bucket_bytes, dtype=torch.uint8)
            return
        rank = init_info.rank_offset + self.parallel_config.rank
        self.group = SyncGroup(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                               init_info.backend, init_info.timeout_s, self.device)
        self.bucket_bytes = init_info.bucket_bytes

    def _in_config(self):
        """vLLM's current config set to this engine's, as vLLM's worker sets it around these calls from 0.27 on
        (v1/worker/gpu_worker.py: 0.26 sets none, and its get_current_vllm_config raises where none is set)."""
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)

    def start_weight_update(self) -> None:
        """Nothing yet: whole weights go through vLLM's layerwise reload, begun by the first of them (update_weights);
        patches are written in place, outside it (vLLM's rule for sparse updates, checkpoint_weight_patch.py)."""
        self.reloading = self.patched = False
        self.targets = None  # a reload may have replaced the parameters
        self.probe_columns = {}

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU ("Cannot access accelerator
        # device when none is available"); receive_weights synchronises this worker's device itself.
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        info = self.parse_update_info(update_info)
        with self._in_config():
            if not info.sparse and not self.reloading:
                initialize_layerwise_reload(self.model)
                self.reloading = True
            self.receive_weights(info)

    def receive_weights(self, update_info: BroadcastUpdateInfo) -> None:
        """Receive the buckets in order, each loaded as it arrives; returns once this worker's device holds them all
        (raises, the group aborted, when the broadcast failed or did not complete within its timeout). With shm, the
        update is one bucket, in the file now."""
        if self.shared is not None:
            self._load_shared(update_info)
            return
        if self.ipc:
            self._load_ipc(update_info)
            return
        if self.group is None:
            raise RuntimeError("the weight-sync group was never formed: init_weight_transfer_engine first")
        named = list(zip(update_info.names, update_info.dtype_names, update_info.shapes))
        fault, self.fault = self.fault, None
        try:
            for k, bucket in enumerate(plan_buckets(named, self.bucket_bytes)):
                load = not (fault == "skip_load" or (fault == "drop_bucket" and k == 0))
                if update_info.sparse:
                    self._receive_patches(bucket, load, fault == "wrong_indices")
                    continue
                numel = sum(torch.Size(shape).numel() for _, _, shape in bucket)
                buffer = torch.empty(numel, dtype=DTYPES[bucket[0][1]], device=self.device)
                self.group.broadcast(buffer)
                if load:
                    self.model.load_weights(unflatten(buffer, bucket))
            self.group.complete()
        except BaseException:
            try:  # no layer left half in reload; the engine stays paused with its old version until a sync completes
                self.finish_weight_update()
            except Exception as e:
                print(f"weight update: finishing the failed reload: {type(e).__name__}: {e}", flush=True)
            raise

    def _receive_patches(self, bucket: list, load: bool = True, shifted: bool = False) -> None:
        """One bucket's patches (sync_group.receive_patches), applied in place. A weight the model holds whole and
        row-major under its checkpoint name (the vocabulary padded at the end at most), or as a block of rows of a
        packed parameter (q, k and v in qkv_proj), takes its values where they go; any other goes through the
        model's own loader: vLLM's load_checkpoint_weight_patches, which writes the elements a patch names and no
        other, tensor-parallel shards included."""
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        if self.targets is None:
            self.targets = _direct_targets(self.model, self.parallel_config.tensor_parallel_size)
        through_loader = []
        for (name, dtype, shape), (indices, values) in zip(bucket, receive_patches(self.group, bucket, self.device)):
            if shifted and indices.numel():
                indices = (indices + 1) % math.prod(shape)
            if not load:
                continue
            param, offset, rows = self.targets.get(name, (None, 0, 0))
            if param is not None and tuple(param.shape[1:]) == tuple(shape[1:]) and shape[0] <= rows:
                param.data.view(-1)[indices.long() + offset] = values.to(param.dtype)
                if param.dim() == 2 and indices.numel():
                    columns = self.probe_columns.setdefault(id(param), set())
                    columns.update(((indices[:PROBED_COLUMNS].long() + offset) % param.shape[1]).tolist())
            else:
                through_loader.append(CheckpointWeightPatch(name, tuple(shape), DTYPES[dtype], values, indices))
        if through_loader:
            load_checkpoint_weight_patches(self.model, through_loader, validate_unique_indices=False)
        self.patched = True

    def _load_shared(self, update_info: BroadcastUpdateInfo) -> None:
        named = list(zip(update_info.names, update_info.dtype_names, update_info.shapes))
        dtype = DTYPES[named[0][1]]
        numel = sum(torch.Size(shape).numel() for _, _, shape in named)
        size = numel * dtype.itemsize
        if size > self.shared.numel():
            raise ValueError(f"a bucket of {size} bytes does not fit the shared file's {self.shared.numel()}")
        flat = self.shared[:size].view(dtype)
        # Cloned: the layerwise reload keeps a layer's tensors until the layer is complete, and the trainer writes
        # the next bucket over this one as soon as this call returns.
        self.model.load_weights((name, t.to(self.device, copy=True)) for name, t in unflatten(flat, named))

    def _load_ipc(self, update_info: BroadcastUpdateInfo) -> None:
        """Each parameter from the handle of this worker's GPU (the trainer ranks send one per GPU, by its UUID),
        rebuilt on this worker's device, loaded; the copies it maps are the trainer's until this call returns, and
        CUDA IPC keeps alive what the layerwise reload still references after (a module not seen whole)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        weights = []
        for name, handles in zip(update_info.names, update_info.ipc_handles or []):
            if uuid not in handles:
                raise ValueError(f"weight update: no CUDA IPC handle of {name} for this worker's GPU {uuid} (handles "
                                 f"for {sorted(handles)}): the trainer rank on this GPU did not share it")
            args = list(handles[uuid])
            args[6] = index  # the sender's device index (rebuild_cuda_tensor's 7th argument): this worker's here
            weights.append((name, rebuild_cuda_tensor(*args)))
        self.model.load_weights(weights)
        synchronize(self.device)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with self._in_config():
            if self.reloading:
                finalize_layerwise_reload(self.model, self.model_config)
                _retie_word_embeddings(self.model)
                _prepack_cpu_experts(self.model)
            elif self.patched:
                _prepare_patched(self.model)
        self.reloading = self.patched = False
        synchronize(self.device)

    def plant_fault(self, kind: str) -> None:
        """For the tests and benchmarks of the sync check: the next update goes wrong in this way ("drop_bucket":
        its first bucket is received and not loaded; "skip_load": nothing is loaded; "wrong_indices": each patch is
        applied one element further on)."""
        self.fault = kind

    def shutdown(self) -> None:
        self.shared = None
        if self.group is not None:
            self.group.close()
            self.group = None

    @staticmethod
    def trainer_send_weights(*args, **kwargs) -> None:
        """Abstract in vLLM's base class before 0.29 (rollout/vllm_compat.py); the trainer's side of this engine is
        trainer/weight_export.py over sync_group.SyncGroup."""
        raise NotImplementedError("openrlhf_async's trainer sends with trainer/weight_export.py")


def keep_cpu_weights() -> None:
    """vLLM-CPU packs each linear layer's weight for its GEMM kernels once loaded and drops the weight
    (layers/utils.py, dispatch_cpu_unquantized_gemm(remove_weight=True), from layers/linear.py): kept instead, a
    patch can be written into it in place and packed again (_prepare_patched), and the sync check can read what the
    engine holds. It costs the memory of a second copy of the linear weights on a CPU engine, not generation speed."""
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "keeps_weights", False):
        return

    def keeping(layer, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    keeping.keeps_weights = True
    utils.dispatch_cpu_unquantized_gemm = keeping


def keep_cpu_expert_weights() -> None:
    """vLLM-CPU prepacks a mixture of experts' weights (w13, w2) for its kernels once loaded
    (fused_moe/experts/cpu_moe.py, CPUUnquantizedExperts.process_weights_after_loading), in place of the checkpoint's
    layout. Kept also in that layout (the layer's checkpoint_w13 / checkpoint_w2), a patch can be written there and
    packed again, and the sync check reads what the engine holds: the memory of a second copy of the experts."""
    CPUUnquantizedExperts = _cpu_experts_class()
    if CPUUnquantizedExperts is None:
        return
    prepack = CPUUnquantizedExperts.process_weights_after_loading
    if getattr(prepack, "keeps_weights", False):
        return

    def keeping(self, layer) -> None:
        layer.checkpoint_w13 = layer.w13_weight.detach().clone()
        layer.checkpoint_w2 = layer.w2_weight.detach().clone()
        prepack(self, layer)

    keeping.keeps_weights = True
    CPUUnquantizedExperts.process_weights_after_loading = keeping


def _cpu_experts_class():
    """vLLM-CPU's unquantized experts kernel, which prepacks the experts' weights; None on a GPU, or in a vLLM before
    0.32 (which lays its CPU experts out elsewhere: no MoE on CPU there)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return None
    return CPUUnquantizedExperts


def _cpu_experts(model) -> list:
    """[(checkpoint prefix of the experts, layer, vLLM-CPU's experts kernel)] of each mixture-of-experts layer whose
    weights vLLM-CPU prepacks (none on a GPU)."""
    kernel_class = _cpu_experts_class()
    if kernel_class is None:
        return []
    found = []
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, kernel_class) and hasattr(module, "checkpoint_w13"):
            found.append((name.removesuffix(".routed_experts"), module, experts))
    return found


def _prepack_cpu_experts(model, from_checkpoint: bool = False) -> None:
    """Pack the experts' weights again after an update: vLLM 0.32 reloads them into the packed tensors' storage in
    the checkpoint's layout and packs nothing (unquantized_fused_moe_method.py, _setup_kernel on a weight update), so
    the CPU kernels would read them as packed; from_checkpoint: from the kept copies a patch was written into."""
    for _, layer, experts in _cpu_experts(model):
        if from_checkpoint:
            layer.w13_weight.data = layer.checkpoint_w13.clone()
            layer.w2_weight.data = layer.checkpoint_w2.clone()
        experts.process_weights_after_loading(layer)


def checkpoint_parameters(model):
    """(name, tensor) of the weights the engine holds, with the experts vLLM-CPU packed in the checkpoint's layout
    (keep_cpu_expert_weights): what the sync check and the tests compare with the trainer's."""
    kept = {}
    for module_name, layer in model.named_modules():
        if hasattr(layer, "checkpoint_w13"):
            kept[f"{module_name}.w13_weight"] = layer.checkpoint_w13
            kept[f"{module_name}.w2_weight"] = layer.checkpoint_w2
    for name, p in model.named_parameters():
        yield name, kept.get(name, p)


PROBED_COLUMNS = 4  # of a patched weight, besides its first and last: where a stale kernel copy differs


def kernel_mismatches(model, patched_columns: dict = None) -> list:
    """The layers whose kernel runs from a copy the engine made of the weight (vLLM-CPU packs each linear layer's
    weight for oneDNN or its own GEMMs: layer.cpu_linear, utils.dispatch_cpu_unquantized_gemm) and no longer computes
    with the weight the layer holds: a repack missed after an update. The fingerprint reads the parameters; this reads
    what the kernels run. Each is probed with one-hot inputs of a few columns (the first, the last, and those this
    update patched: patched_columns by id of the parameter), whose outputs are exactly those columns of the weight
    (a product by 1 and sums of zeros round nothing). On a GPU no layer has a copy: its kernels read the parameters."""
    import torch.nn.functional as F

    mismatched = []
    for name, module in model.named_modules():
        linear, weight = getattr(module, "cpu_linear", None), getattr(module, "weight", None)
        if linear is None or linear is F.linear or weight is None or weight.dim() != 2 or not weight.numel():
            continue
        extra = sorted((patched_columns or {}).get(id(weight), ()))
        columns = torch.tensor(sorted({0, weight.shape[1] - 1, *extra}), device=weight.device)
        probe = torch.zeros(len(columns), weight.shape[1], dtype=weight.dtype, device=weight.device)
        probe[torch.arange(len(columns)), columns] = 1
        with torch.no_grad():
            out = linear(probe, weight, None)
        if not torch.equal(out.float(), weight[:, columns].t().float()):
            mismatched.append(name)
    return mismatched


def checkpoint_pieces(model):
    """(checkpoint name, block of rows of a parameter [k, m], the block's first row and column in that weight) for
    every weight this worker holds: q, k and v of qkv_proj (k and v: the key/value heads of this worker's group, which
    vLLM replicates where the workers outnumber them: num_kv_head_replicas), gate and up of gate_up_proj, this worker's
    rows or columns of a tensor-parallel weight, its vocabulary rows (padding left out), each expert's rows of w13
    and w2 (vLLM-CPU: of the kept checkpoint layout); any other parameter whole, under its own name. What the sync
    check fingerprints (sync_group.pieces_fingerprint)."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed, seen = getattr(model, "packed_modules_mapping", {}) or {}, set()
    for module_name, module in model.named_modules():
        prefix, _, last = module_name.rpartition(".")
        own = {kind: p for kind, p in module.named_parameters(recurse=False) if id(p) not in seen}
        seen.update(id(p) for p in own.values())
        parts = packed.get(last) or []
        for kind, p in own.items():
            name, rows = f"{module_name}.{kind}", p.data.view(p.shape[0], -1) if p.dim() else p.data.view(1, 1)
            if isinstance(module, QKVParallelLinear) and len(parts) == 3:
                kv = module.tp_rank // module.num_kv_head_replicas
                sizes = (module.num_heads * module.head_size, module.num_kv_heads * module.head_size,
                         module.num_kv_heads * module.v_head_size)
                yield from _stacked(prefix, parts, kind, rows, sizes, (module.tp_rank, kv, kv))
            elif isinstance(module, MergedColumnParallelLinear) and len(parts) == len(module.output_sizes):
                sizes = [size // module.tp_size for size in module.output_sizes]
                yield from _stacked(prefix, parts, kind, rows, sizes, [module.tp_rank] * len(sizes))
            elif isinstance(module, ColumnParallelLinear) and not parts:
                yield name, rows, module.tp_rank * rows.shape[0], 0
            elif isinstance(module, RowParallelLinear) and kind == "weight":
                yield name, rows, 0, module.tp_rank * rows.shape[1]
            elif isinstance(module, VocabParallelEmbedding) and kind == "weight":
                shard = module.shard_indices
                yield name, rows[: shard.num_org_elements], shard.org_vocab_start_index, 0
            elif kind in ("w13_weight", "w2_weight") and hasattr(module, "local_num_experts"):
                yield from _expert_pieces(prefix if last == "routed_experts" else module_name, module, kind)
            else:
                yield name, rows, 0, 0


def _stacked(prefix: str, parts: list, kind: str, rows, sizes, shards):
    """The parts of a packed parameter stacked by rows (sizes: each part's rows here; shards: which of its shards)."""
    first = 0
    for part, size, shard in zip(parts, sizes, shards):
        yield f"{prefix}.{part}.{kind}", rows[first : first + size], shard * size, 0
        first += size


def _expert_pieces(prefix: str, module, kind: str):
    """Each local expert's checkpoint weights in w13 [experts, gate rows then up rows, hidden] or w2 [experts,
    hidden, this worker's intermediate columns]."""
    weight = getattr(module, "checkpoint_w13" if kind == "w13_weight" else "checkpoint_w2", None)
    weight = getattr(module, kind) if weight is None else weight
    tp_rank = getattr(getattr(getattr(module, "moe_config", None), "moe_parallel_config", None), "tp_rank", 0)
    expert_map = getattr(module, "expert_map", None)  # global id -> local id (-1: another worker's)
    experts = (range(weight.shape[0]) if expert_map is None else
               [int(g) for g in (expert_map >= 0).nonzero().reshape(-1).tolist()])
    for local, e in enumerate(experts):
        if kind == "w13_weight":
            size = weight.shape[1] // 2
            yield f"{prefix}.{e}.gate_proj.weight", weight[local, :size], tp_rank * size, 0
            yield f"{prefix}.{e}.up_proj.weight", weight[local, size:], tp_rank * size, 0
        else:
            yield f"{prefix}.{e}.down_proj.weight", weight[local], 0, tp_rank * weight.shape[2]


def _direct_targets(model, tensor_parallel: int) -> dict:
    """{checkpoint name: (parameter, flat offset of its first element there, rows it has there)} for the weights a
    patch can be written into without the loader: with one tensor-parallel worker, each parameter under its own name
    (rows: its own), and each part of a packed one (the model's packed_modules_mapping: qkv_proj of q_proj, k_proj and
    v_proj, stacked by rows in that order, output_sizes rows each)."""
    if tensor_parallel > 1:
        return {}
    targets = {name: (p, 0, p.shape[0] if p.dim() else 1) for name, p in model.named_parameters()
               if p.is_contiguous() and p.numel()}
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    for module_name, module in model.named_modules():
        parts = packed.get(module_name.rsplit(".", 1)[-1])
        sizes = getattr(module, "output_sizes", None)
        if not parts or not sizes or len(sizes) != len(parts):
            continue
        prefix = module_name.rsplit(".", 1)[0]
        for kind in ("weight", "bias"):
            param = getattr(module, kind, None)
            if param is None or not param.is_contiguous() or param.shape[0] != sum(sizes):
                continue
            row = param[0].numel()
            for k, part in enumerate(parts):
                targets[f"{prefix}.{part}.{kind}"] = (param, sum(sizes[:k]) * row, sizes[k])
    for prefix, layer, _ in _cpu_experts(model):  # each expert's weights in the kept checkpoint copies, as rows
        w13, w2 = layer.checkpoint_w13, layer.checkpoint_w2
        size = w13.shape[1] // 2
        rows13, rows2 = w13.view(-1, w13.shape[-1]), w2.view(-1, w2.shape[-1])
        for e in range(w13.shape[0]):
            targets[f"{prefix}.{e}.gate_proj.weight"] = (rows13, e * w13[0].numel(), size)
            targets[f"{prefix}.{e}.up_proj.weight"] = (rows13, e * w13[0].numel() + w13[0, :size].numel(), size)
            targets[f"{prefix}.{e}.down_proj.weight"] = (rows2, e * w2[0].numel(), w2.shape[1])
    return targets


def _prepare_patched(model) -> None:
    """After patches written in place: on CPU, pack every unquantized linear and embedding layer's weight, and the
    experts', again for its kernels, as loading does (a GPU runs its layers from the parameters themselves)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    _prepack_cpu_experts(model, from_checkpoint=True)
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
            method.process_weights_after_loading(module)


def _retie_word_embeddings(model) -> None:
    # A tied lm_head gets no weights of its own in a reload, so nothing refreshes the copy the head's kernel was
    # prepared from (vLLM-CPU packs it after loading): re-tie it and prepare it again.
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "lm_head") and hasattr(model, "model"):
        head, embed = model.lm_head, model.model.embed_tokens
        if head.weight is not embed.weight:
            head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)
