"""The trainer side of the weight transfer into the vLLM engines (vLLM's weight_transfer: a weight source and a
trainer-side engine per transport): what the engines load, gathered from the policy rank's ZeRO partitions a bucket
at a time, and the three ways it travels:

- broadcast: rank 0 sends each bucket over the weight-sync group (NCCL on GPU, gloo on CPU; rollout/sync_group.py),
  which trainer/weight_sync.py forms with the engines' workers;
- a shared-memory file: the hybrid engine on cpu, the rank on an engine's devices writes each bucket where its engine
  maps it (trainer/hybrid.py);
- CUDA IPC: the hybrid engine on cuda, the ranks' copies of each bucket exported as handles in vLLM's IPC form.

Every rank gathers every bucket (a ZeRO-3 collective), whatever the transport. A policy rank (policy.py) holds one;
the receiving side is rollout/weight_transfer.py."""

import contextlib
import math
import os
import struct
import zlib
from typing import NamedTuple, Optional

import torch

from openrlhf_async.rollout.sync_group import bytes_of, fingerprint, send_patches
from openrlhf_async.utils.ports import free_port

# The probe a weight sync checks the engines with: the engines' greedy continuation of each, scored by the trainer.
PROBE_TEXTS = ("The capital of France is", "12 + 30 =")


class Source(NamedTuple):
    """One weight the engines load: its name there, the parameters its value is made of, the LoRA adapter's scaling
    (None: the parameter as it is), and the piece of the parameter it is (None: the whole; else (first flat element,
    shape): one expert's weight in the fused tensor of a mixture of experts)."""

    name: str
    params: list
    scaling: Optional[float] = None
    piece: Optional[tuple] = None

    def shape(self) -> tuple:
        return self.piece[1] if self.piece else tuple(getattr(self.params[0], "ds_shape", self.params[0].shape))

    def span(self) -> tuple:
        """(first, end) flat elements of the parameter this weight covers."""
        first = self.piece[0] if self.piece else 0
        return first, first + math.prod(self.shape())


def weight_sources(module, lora: bool) -> list:
    """What the engines load, in the module's order (Source). Without LoRA, each parameter as it is, but for the
    fused experts of a mixture of experts: one weight per expert, named as the checkpoint names it (expert_pieces).
    With LoRA, the base model's names, and an adapted layer's weight merged: W + scaling x B @ A (computed apart,
    nothing merged in place: under ZeRO-3 W is a partition)."""
    if not lora:
        return [source for name, p in module.named_parameters() for source in expert_pieces(name, p)]
    base = module.get_base_model()
    layers = dict(base.named_modules())
    sources = []
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        if name.endswith(".base_layer.weight"):
            layer = layers[name[: -len(".base_layer.weight")]]
            sources.append(Source(name.replace(".base_layer", ""),
                                  [p, layer.lora_A["default"].weight, layer.lora_B["default"].weight],
                                  layer.scaling["default"]))
        else:
            sources.append(Source(name.replace(".base_layer", ""), [p]))
    return sources


def expert_pieces(name: str, param) -> list:
    """A parameter as the engines load it. transformers (5) holds a mixture of experts' expert weights fused,
    `experts.gate_up_proj` [experts, 2 x size, hidden] (each expert's gate rows, then its up rows) and
    `experts.down_proj` [experts, hidden, size], where a checkpoint (and vLLM's loader) names each expert's:
    `experts.{e}.gate_proj.weight`, `.up_proj.weight`, `.down_proj.weight`. Each is a contiguous run of the fused
    tensor's elements, sent as such; any other parameter is one weight."""
    shape = tuple(getattr(param, "ds_shape", param.shape))
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith(".experts") or leaf not in ("gate_up_proj", "down_proj") or len(shape) != 3:
        return [Source(name, [param])]
    experts, rows, cols = shape
    per_expert = rows * cols
    if leaf == "down_proj":
        return [Source(f"{prefix}.{e}.down_proj.weight", [param], None, (e * per_expert, (rows, cols)))
                for e in range(experts)]
    half = rows // 2
    return [Source(f"{prefix}.{e}.{kind}_proj.weight", [param], None, (e * per_expert + k * half * cols, (half, cols)))
            for e in range(experts) for k, kind in enumerate(("gate", "up"))]


def source_value(source: Source) -> torch.Tensor:
    """A weight as the engines load it, from its (gathered) parameters (weight_sources). A merged weight in bf16 or
    fp16 is rounded stochastically (stochastic_round), seeded by its name and its adapter's values: round to nearest
    would drop every update below half a unit in the last place of W (about 6e-5 at |W| = 0.02 in bf16), which an
    adapter's first steps are, so they would never reach the engines."""
    if source.piece is not None:
        first, end = source.span()
        return source.params[0].data.reshape(-1)[first:end].view(source.shape())
    if source.scaling is None:
        return source.params[0].data
    weight, a, b = (t.data for t in source.params)
    merged = weight.float() + (b.float() @ a.float()) * source.scaling
    if weight.dtype == torch.float32:
        return merged
    seed = zlib.crc32(struct.pack("<d", float(b.double().sum())), zlib.crc32(source.name.encode()))
    return stochastic_round(merged, weight.dtype, seed)


def stochastic_round(x: torch.Tensor, dtype, seed: int) -> torch.Tensor:
    """x (fp32) in dtype, each element rounded to one of its two neighbours in dtype with the probability that makes
    the expected value x (unbiased: E[result] = x), drawn from a generator seeded with seed (the same seed, the same
    result on every rank)."""
    nearest = x.to(dtype)
    away = torch.where(nearest.float() < x, torch.inf, -torch.inf).to(dtype)
    other = torch.nextafter(nearest, away)
    gap = (other.float() - nearest.float()).abs()
    p_other = torch.where(gap > 0, (x - nearest.float()).abs() / gap, torch.zeros_like(x))
    generator = torch.Generator(device=x.device).manual_seed(seed)
    draw = torch.rand(x.shape, generator=generator, device=x.device)
    return torch.where(draw < p_other, other, nearest)


def probe_ids(model_path) -> list:
    """The token ids of the fixed probe texts the weight sync checks the engines with (trainer/weight_sync.py)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return [tokenizer(text)["input_ids"] for text in PROBE_TEXTS]


SAMPLE = 61  # a sync of every weight counts the changed elements among every 61st (a prime: no row's period)


def _changed(part: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Where two tensors of one dtype differ bit for bit (a change of sign of a zero counts; NaN equals itself)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[part.element_size()]
    return part.view(ints) != previous.view(ints)


def _gather_patches(local: list) -> list:
    """Every rank's [(global flat indices, values)] per weight, joined in rank order on each rank (an all-gather
    over the trainer's ranks, of equal-sized buffers: the largest rank's)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    device = local[0][1].device
    counts = torch.tensor([len(i) for i, _ in local], dtype=torch.int64, device=device)
    all_counts = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(all_counts, counts)
    totals = [int(c.sum()) for c in all_counts]
    width = max(totals)
    indices = torch.zeros(width, dtype=torch.int64, device=device)
    values = torch.zeros(width, dtype=local[0][1].dtype, device=device)
    mine = sum(len(i) for i, _ in local)
    if mine:
        indices[:mine] = torch.cat([i for i, _ in local])
        values[:mine] = torch.cat([v for _, v in local])
    all_indices = [torch.empty_like(indices) for _ in range(world)]
    all_values = [torch.empty_like(values) for _ in range(world)]
    dist.all_gather(all_indices, indices)
    dist.all_gather(all_values, values)
    per_rank = [list(zip(i[:t].split(c.tolist()), v[:t].split(c.tolist())))
                for i, v, t, c in zip(all_indices, all_values, totals, all_counts)]
    return [(torch.cat([rank[k][0] for rank in per_rank]), torch.cat([rank[k][1] for rank in per_rank]))
            for k in range(len(local))]


class WeightExport:
    """One policy rank's weights as the engines load them, and its part in each transport."""

    def __init__(self, module, lora: bool, zero_stage: int, rank: int, timeline):
        """module: the rank's trained module (DeepSpeed's engine.module); timeline: the rank's, for its sync spans."""
        self.module, self.zero_stage, self.rank, self.timeline = module, zero_stage, rank, timeline
        self.sources = weight_sources(module, lora)
        self.sync_group = None  # rank 0's side of the weight-sync group
        self.weight_file = self.held = None  # the hybrid engine's: shared bucket (cpu) or IPC-shared tensors (cuda)
        self.lora = lora
        # The sparse sync's baseline: this rank's part of each weight as the engines hold it since the last sync
        # (owned), kept where the sync keeps one (track); None until a sync of every weight took it.
        self.previous = None
        self.sent = self.patch_bytes = 0  # the last sync's elements and bytes broadcast (rank 0)
        self.changed = (0, 0)  # the last sync's elements of this rank's parts changed since the one before, of all
        self.fingerprint = {}  # with LoRA, of the merged weights rank 0 sent since begin_sync

    def _device(self):
        return next(self.module.parameters()).device

    def named_shapes(self) -> list:
        """[(name, dtype, shape)] of what the engines load (weight_sources), in order."""
        return [(source.name, str(source.params[0].dtype).replace("torch.", ""), source.shape())
                for source in self.sources]

    @contextlib.contextmanager
    def gathered(self, names: list, count: bool = False):
        """The named weights' sources gathered (a collective over the ZeRO-3 ranks: every rank enters with the same
        names); yields a function returning their values as the engines load them. count: with LoRA, add them to
        the fingerprint of what this sync sent (on rank 0: every rank gathers the same values), since a merged
        weight exists only gathered."""
        import deepspeed

        by_name = {source.name: source for source in self.sources}
        chosen = [by_name[n] for n in names]
        params = list({id(p): p for source in chosen for p in source.params}.values())  # an expert's: once
        with deepspeed.zero.GatheredParameters(params, enabled=self.zero_stage == 3):
            values = []

            def computed() -> list:
                if not values:
                    values.extend(source_value(source) for source in chosen)
                return values

            if count and self.lora and self.rank == 0:
                fingerprint(zip(names, computed()), self.fingerprint, values=True)
            yield computed

    def read_weight(self, name: str) -> torch.Tensor:
        """A weight as the engines load it (with LoRA: the base's name, merged), gathered: a collective."""
        with self.gathered([name]) as values:
            return values()[0].detach().float().cpu().clone()

    # ---- broadcast over the weight-sync group ----------------------------------------------------------------------

    def weight_sync_address(self) -> tuple:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def init_weight_sync_group(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        if self.rank != 0:
            return
        from openrlhf_async.rollout.sync_group import SyncGroup

        if self.sync_group is not None:  # a group of earlier members
            self.sync_group.close()
            self.sync_group = None
        self.sync_group = SyncGroup(host, port, 0, world_size, backend, timeout_s, self._device())

    def broadcast_weights(self, buckets: list, track: bool = False) -> bool:
        """Gather each bucket's parameters (collective over the ZeRO-3 ranks) and broadcast them from rank 0.
        Returns whether every broadcast completed (not merely started: NCCL's wait does not block): when one fails
        (an engine died or hangs), rank 0 stops broadcasting but keeps gathering with the other ranks, so the
        trainer's own collectives stay in step, and the group is aborted. track: keep this rank's part of every
        weight as the baseline of the next sparse sync (broadcast_patches)."""
        ok = True
        with self.timeline.span("sync"):
            for bucket in buckets:
                with self.gathered([name for name, _, _ in bucket], True) as values:
                    if self.rank == 0 and ok:
                        flat = torch.cat([t.reshape(-1) for t in values()])
                        ok = self._sync_step(self.sync_group.broadcast, flat)
            if self.rank == 0 and ok:
                ok = self._sync_step(self.sync_group.complete)
            self.changed = (0, 0)
            if track:
                self._track()
            else:
                self.previous = None
        self.sent = sum(math.prod(shape) for bucket in buckets for _, _, shape in bucket)
        self.patch_bytes = sum(bytes_of(bucket) for bucket in buckets)
        return ok

    # ---- sparse: only the elements that changed -----------------------------------------------------------------

    def _owned(self) -> dict:
        """{name: (offset, this rank's part of the weight, flat)}: its ZeRO-3 partition (padding cut off), or,
        where every rank holds every weight, an equal share of it. No rank holds a second copy of the whole."""
        import torch.distributed as dist

        owned = {}
        for source in self.sources:
            p = source.params[0]
            if self.zero_stage == 3:
                size = p.ds_tensor.ds_numel
                offset = size * dist.get_rank(group=p.ds_process_group)
                part = p.ds_tensor.data.reshape(-1)[: max(0, min(size, p.ds_numel - offset))]
            else:
                world, rank = dist.get_world_size(), dist.get_rank()
                share = -(-p.numel() // world)
                offset, part = share * rank, p.data.reshape(-1)[share * rank : share * (rank + 1)]
            first, end = source.span()  # the weight's elements in the parameter: this rank's of them
            lo = max(first, offset)
            hi = max(lo, min(end, offset + len(part)))
            owned[source.name] = (lo - first, part[lo - offset : hi - offset])
        return owned

    def _track(self) -> None:
        """After a sync of every weight: the baseline becomes this rank's parts as sent, and how much changed since
        the baseline before (the next sync's choice) is estimated from every SAMPLE-th element: a pass over
        1/SAMPLE of the weights, where counting every element would cost a sync of every weight a fifth more."""
        owned = self._owned()
        if self.previous is None:
            self.previous = {name: part.clone() for name, (_, part) in owned.items()}
            return
        changed = sampled = 0
        for name, (_, part) in owned.items():
            changed += int(_changed(part[::SAMPLE], self.previous[name][::SAMPLE]).sum())
            sampled += len(part[::SAMPLE])
            self.previous[name].copy_(part)
        self.changed = (changed, sampled)

    def broadcast_patches(self, buckets: list) -> bool:
        """The sparse sync: for each bucket, each rank finds the elements of its parts that changed since the
        baseline (bit for bit, in the dtype the engines hold), rank 0 gathers them (a collective over the trainer's
        ranks) and broadcasts them as patches in checkpoint coordinates (name, flat indices, values:
        sync_group.send_patches). The baseline becomes the weights sent. Returns as broadcast_weights does."""
        import torch.distributed as dist

        ok, owned = True, self._owned()
        self.sent = self.patch_bytes = 0
        self.changed = (0, sum(part.numel() for _, part in owned.values()))
        with self.timeline.span("sync"):
            for bucket in buckets:
                local = []
                for name, _, _ in bucket:
                    offset, part = owned[name]
                    where = _changed(part, self.previous[name]).nonzero().reshape(-1)
                    local.append((where + offset, part[where]))
                    self.changed = (self.changed[0] + len(where), self.changed[1])
                    self.previous[name].copy_(part)
                patches = _gather_patches(local) if dist.is_initialized() and dist.get_world_size() > 1 else local
                if self.rank == 0:
                    self.sent += sum(len(i) for i, _ in patches)
                    sent = []
                    ok = ok and self._sync_step(
                        lambda: sent.append(send_patches(self.sync_group, bucket, patches, self._device())))
                    self.patch_bytes += sum(sent)
            if self.rank == 0 and ok:
                ok = self._sync_step(self.sync_group.complete)
        return ok

    def begin_sync(self) -> None:
        self.fingerprint = {}

    def weights_fingerprint(self, values: bool = False) -> dict:
        """This rank's share of the fingerprint (sync_group.fingerprint) of the weights the engines should hold
        after a sync: that of its part of each weight (the ranks' add up to the whole's); with LoRA, rank 0's of
        the merged weights it sent."""
        if self.lora:
            return self.fingerprint
        shapes = {source.name: source.shape() for source in self.sources}
        return fingerprint(((name, part, offset, shapes[name]) for name, (offset, part) in self._owned().items()),
                           values=values)

    def sync_figures(self) -> tuple:
        """The last sync's (elements sent, bytes broadcast: rank 0's; elements of this rank's parts changed since the
        sync before, of how many: 0 of 0 where unknown)."""
        return self.sent, self.patch_bytes, *self.changed

    @staticmethod
    def _sync_step(step, *args) -> bool:
        try:
            step(*args)
            return True
        except Exception as e:  # the group is aborted: the trainer drops its bad members and forms it again
            print(f"weight broadcast failed: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
            return False

    # ---- a shared-memory file (the hybrid engine on cpu) -------------------------------------------------------------

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
        with self.timeline.span("sync"), self.gathered([name for name, _, _ in bucket], True) as values:
            if self.weight_file is not None:
                flat = self.weight_file[1]
                offset = 0
                for t in values():
                    data = t.reshape(-1)
                    size = data.numel() * data.element_size()
                    flat[offset : offset + size].view(data.dtype).copy_(data)
                    offset += size
        return True

    # ---- CUDA IPC (the hybrid engine on cuda) ------------------------------------------------------------------------

    def share_bucket(self, bucket: list, owner: bool):
        """cuda: gather one bucket's parameters and, on a rank with an engine on its GPU, copy them into tensors kept
        until release_shared, exported as CUDA IPC handles: per parameter {this GPU's UUID: rebuild args}, the form of
        vLLM's IPC weight-transfer engine. Not run here (no GPU in this project's CI)."""
        from torch.multiprocessing.reductions import reduce_tensor

        handles = None
        with self.timeline.span("sync"), self.gathered([name for name, _, _ in bucket], True) as values:
            if owner:
                uuid = str(torch.cuda.get_device_properties(self._device()).uuid)
                kept = [t.detach().clone() for t in values()]
                self.held = (self.held or []) + kept  # until the engine's update_weights of the bucket returns
                handles = [{uuid: reduce_tensor(t)[1]} for t in kept]
        return handles

    def release_shared(self) -> None:
        """Drop the copies the engine read (after each bucket's update, and at its finish) and give their blocks
        back to the device: kept in this process's caching allocator they would stay out of reach of the engine
        (another process), which wakes its KV cache next. A copy the engine still references (a module vLLM has not
        seen whole) is not lost: CUDA IPC keeps its block until the engine lets go, and ipc_collect frees it then."""
        self.held = None
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
