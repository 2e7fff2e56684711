"""The weight-sync group as both of its sides use it, trainer rank 0 (the sender) and each vLLM worker (through the
weight-transfer engine of weight_transfer.py): the buckets the policy is sent in, and a process group of its own with
NCCL's semantics handled (on gloo the same code). Plain torch: it imports nowhere else."""

import math
import os
import re
import threading
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def plan_buckets(named_shapes: list, bucket_bytes: int) -> list:
    """Group [(name, dtype, shape)] into buckets of at most bucket_bytes (one dtype per bucket), in order, never
    splitting a decoder layer's weights (`...layers.N.*`, where its dtype is one) across two: vLLM's layerwise reload
    keeps the weights of a module it has not seen whole until the rest arrive, so with whole layers each bucket is
    consumed by the call that brings it (its sender may drop it then: trainer/hybrid.py). A layer larger than
    bucket_bytes is a bucket of its own."""
    buckets, current, size = [], [], 0
    for unit in _layers(named_shapes):
        dtype, nbytes = unit[0][1], bytes_of(unit)
        if current and (size + nbytes > bucket_bytes or current[0][1] != dtype):
            buckets.append(current)
            current, size = [], 0
        current += [(name, d, tuple(shape)) for name, d, shape in unit]
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def _layers(named_shapes: list) -> list:
    """Consecutive weights of one decoder layer (and one dtype) as one unit; any other weight alone."""
    units, key = [], None
    for item in named_shapes:
        match = re.match(r"(.*\.layers\.\d+)\.", item[0])
        here = (match.group(1), item[1]) if match else None
        if here is not None and here == key:
            units[-1].append(item)
        else:
            units.append([item])
        key = here
    return units


def bytes_of(bucket: list) -> int:
    """The bytes of [(name, dtype, shape)]'s weights."""
    return sum(DTYPES[dtype].itemsize * math.prod(shape) for _, dtype, shape in bucket)


def unflatten(buffer: torch.Tensor, bucket: list):
    """Split a flat bucket into (name, tensor) views; bucket is [(name, dtype, shape), ...]."""
    offset = 0
    for name, _, shape in bucket:
        numel = math.prod(shape)
        yield name, buffer[offset : offset + numel].view(shape)
        offset += numel


def patch_index_dtype(bucket: list) -> torch.dtype:
    """The dtype of a bucket's patch indices: flat positions in each weight, int32 where every weight has fewer than
    2^31 elements (vLLM's sparse engine sends int32)."""
    return torch.int32 if max(math.prod(shape) for _, _, shape in bucket) < 2**31 else torch.int64


def send_patches(group, bucket: list, patches: list, device) -> int:
    """Broadcast one bucket's patches [(flat indices, ascending; values)], one per weight of bucket, from rank 0: a
    header (each weight's count of changed elements, and the form of the positions), then the positions, then the
    values. The positions go as flat indices (4 bytes each), or, where fewer bytes, as a bitmap of the bucket's
    elements (1 bit each: past 1 in 32 elements changed). Returns the bytes sent."""
    counts = [len(indices) for indices, _ in patches]
    numels = [math.prod(shape) for _, _, shape in bucket]
    index_dtype = patch_index_dtype(bucket)
    bitmap = sum(numels) < 32 * sum(counts) * index_dtype.itemsize // 4
    header = torch.tensor(counts + [int(bitmap)], dtype=torch.int64, device=device)
    if bitmap:
        offsets = torch.tensor([0] + numels[:-1], device=device).cumsum(0)
        where = torch.cat([i.to(device, torch.int64) + o for (i, _), o in zip(patches, offsets)])
        positions = _pack_bits(where, sum(numels), device)
    else:
        positions = torch.cat([i.to(device, index_dtype) for i, _ in patches])
    values = torch.cat([v.to(device, DTYPES[bucket[0][1]]) for _, v in patches])
    for tensor in (header, positions, values):
        group.broadcast(tensor)
    return sum(t.numel() * t.element_size() for t in (header, positions, values))


def receive_patches(group, bucket: list, device) -> list:
    """send_patches' other side: [(flat indices, values)] per weight of bucket."""
    header = torch.empty(len(bucket) + 1, dtype=torch.int64, device=device)
    group.broadcast(header)
    sizes, bitmap = header[:-1].tolist(), bool(header[-1])
    numels = [math.prod(shape) for _, _, shape in bucket]
    positions = torch.empty((sum(numels) + 7) // 8 if bitmap else sum(sizes),
                            dtype=torch.uint8 if bitmap else patch_index_dtype(bucket), device=device)
    values = torch.empty(sum(sizes), dtype=DTYPES[bucket[0][1]], device=device)
    group.broadcast(positions)
    group.broadcast(values)
    if bitmap:
        indices = _unpack_bits(positions, numels)
    else:
        indices = positions.split(sizes)
    return list(zip(indices, values.split(sizes)))


_BIT_VALUES = (1, 2, 4, 8, 16, 32, 64, 128)


def _pack_bits(where: torch.Tensor, numel: int, device) -> torch.Tensor:
    """A bitmap of numel elements (uint8, eight a byte, the first the lowest bit) with those at `where` set (numpy's
    packbits on cpu, a pass in C; torch's ops elsewhere)."""
    if torch.device(device).type == "cpu":
        import numpy as np

        flags = np.zeros(numel, dtype=bool)
        flags[where.cpu().numpy()] = True
        return torch.from_numpy(np.packbits(flags, bitorder="little"))
    flags = torch.zeros((numel + 7) // 8 * 8, dtype=torch.uint8, device=device)
    flags[where] = 1
    return (flags.view(-1, 8) * torch.tensor(_BIT_VALUES, dtype=torch.uint8, device=device)).sum(1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, numels: list) -> list:
    """_pack_bits' other side, split into parts of numels elements: the flat indices set in each."""
    numel = sum(numels)
    if packed.device.type == "cpu":
        import numpy as np

        flags = np.unpackbits(packed.numpy(), count=numel, bitorder="little").view(bool)
        bounds = np.cumsum([0] + numels)
        return [torch.from_numpy(np.flatnonzero(flags[a:b])) for a, b in zip(bounds[:-1], bounds[1:])]
    bits = torch.tensor(_BIT_VALUES, dtype=torch.uint8, device=packed.device)
    flags = ((packed.view(-1, 1) & bits) != 0).reshape(-1)[:numel]
    return [part.nonzero().reshape(-1) for part in flags.split(numels)]


def open_sync_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float):
    """A process group of its own (outside torch.distributed's default one) for the weight broadcast, whose
    rendezvous and collectives give up after timeout_s: a member that died or hangs makes the others fail in time,
    never wait for ever. Returns (group, its rendezvous store), both kept by the caller: rank 0 (the trainer) serves
    the store."""
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore
    from vllm.distributed.utils import init_gloo_process_group

    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    prefix = PrefixStore("weight_sync", store)
    if backend in ("gloo", GLOO_AS_NCCL):
        group = init_gloo_process_group(prefix_store=prefix, group_rank=rank, group_size=world_size, timeout=timeout)
        if backend == GLOO_AS_NCCL:
            group = NcclLikeGroup(group, rank, world_size)
    else:
        from vllm.platforms import current_platform

        # ProcessGroupNCCL reads this when it is built; its default (3) ends the process when a collective times out
        # (a dead engine would take trainer rank 0 with it). 2 only aborts this group's communicator.
        previous = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        try:
            group = current_platform.stateless_init_device_torch_dist_pg(
                backend=backend, prefix_store=prefix, group_rank=rank, group_size=world_size, timeout=timeout)
        finally:
            if previous is None:
                os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING")
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = previous
    return group, store  # the store must outlive the rendezvous (rank 0 serves it)


# gloo carrying the data with NCCL's documented semantics (NcclLikeGroup): the backend by which the CPU tests check
# the code written for NCCL, where gloo's stricter semantics would let pass what breaks on NCCL.
GLOO_AS_NCCL = "gloo_as_nccl"


class NcclLikeGroup:
    """A gloo group that behaves as NCCL's does where the two differ. A broadcast goes down a chain 0 -> 1 -> ... (as
    NCCL's ring does), so a member that died or hangs stalls every member after it; wait() never raises and holds
    the host only as long as a later read of the data on the device would wait (a receiver's; NCCL orders the
    device's stream instead); a collective that failed never completes, as one on a dead peer never does on NCCL."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def broadcast(self, tensor: torch.Tensor, root: int = 0):
        work = NcclLikeWork()
        try:
            if self.rank > 0:
                self.group.recv([tensor], self.rank - 1, 0).wait()  # forwarded once here (NCCL pipelines it)
            if self.rank + 1 < self.size:
                send = self.group.send([tensor], self.rank + 1, 0)  # gloo completes a send only inside its wait()
                threading.Thread(target=lambda: _went_through(send) and work.done.set(), daemon=True).start()
            else:
                work.done.set()
        except Exception:  # a dead peer: the collective never completes, and nothing says so
            pass
        return work

    def abort(self) -> None:
        self.group.abort()


class NcclLikeWork:
    def __init__(self):
        self.done = threading.Event()

    def wait(self, *args) -> bool:
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


def _went_through(work) -> bool:
    try:
        work.wait()
        return True
    except Exception:
        return False


def synchronize(device: torch.device) -> None:
    """Wait until the device finished what was queued on it (a no-op on cpu, where nothing is queued)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


class SyncGroup:
    """One member's side of the weight-sync group (trainer rank 0 or an engine worker), used as NCCL's documented
    semantics require; gloo's are stricter, so the same code is right on both. An NCCL broadcast's wait() only orders
    this device's stream after it: it neither blocks the host nor raises, and a dead peer blocks the stream, not the
    caller. So a member broadcasts every bucket, then complete() checks on the host, within timeout_s, that the last
    one (a group's collectives complete in order) finished, and synchronises the device. A group that failed is
    aborted, which also frees a device stream stuck on a dead peer, and never used again."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
                 device="cpu"):
        self.group, self.store = open_sync_group(host, port, rank, world_size, backend, timeout_s)
        self.timeout_s, self.device = timeout_s, torch.device(device)
        self.last, self.failed = None, False

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Send tensor from rank 0 (receive it elsewhere); what reads it later on this device reads the data."""
        if self.failed:
            raise RuntimeError("the weight-sync group failed and was aborted; it must be formed again")
        try:
            self.last = self.group.broadcast(tensor, root=0)
            self.last.wait()
        except BaseException:
            self.abort()
            raise

    def complete(self) -> None:
        """Return once every broadcast so far has landed and the device holds the data; raise, with the group
        aborted, when a broadcast failed or the last one did not complete within timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        try:
            if self.last is not None:
                while not self.last.is_completed():  # a host-side query (NCCL: of a CUDA event); it never blocks
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the weight broadcast did not complete within {self.timeout_s:g} s")
                    time.sleep(0.002)
                self.last.wait()  # raises the broadcast's error, if it failed
            synchronize(self.device)
        except BaseException:
            self.abort()
            raise
        finally:
            self.last = None

    def abort(self) -> None:
        """Abort the group where it stands: local, it waits on no peer (ncclCommAbort on NCCL)."""
        self.failed = True
        try:
            self.group.abort()
        except Exception as e:  # a group already torn down
            print(f"weight-sync group abort: {type(e).__name__}: {e}", flush=True)

    def close(self) -> None:
        """Give the group up before another is formed: aborted, never destroyed collectively (peers may be gone)."""
        if not self.failed:
            self.abort()
        self.group = self.store = None


# ---- the fingerprint a weight sync is checked with ---------------------------------------------------------------
# Weights as the engines hold them are compared exactly, in checkpoint coordinates, grouped so that a difference
# names its decoder layer (`...layers.N.`; every other weight falls in "rest"). A weight W (checkpoint name n, seen as
# rows W[r] of the first dimension, each row as 16-bit halves h: one a bf16 element, two an fp32 one) adds
# Σ_r a_n(r) Σ_c v(c) h_rc mod 2^64 to its group: a_n(r) an odd 64-bit hash of (n, r), v(c) an odd integer hash of c
# below 2^20 in size. Each row's inner sum is taken in float64 over blocks of at most 2^17 halves, so it is an integer
# below 2^52: exact in any order (on a CPU a compiled loop takes the same integer in int64, _cpu_kernel); the rest is
# wrapping integer arithmetic. So the tolerance is zero, any partition of a weight (ZeRO-3 ranks' flat ranges,
# tensor-parallel shards, q/k/v packed in one parameter) adds up to the whole's, and an element that moves (k and v
# swapped, two experts, gate and up, permuted heads) or two that change together (two sign bits) changes the sum
# unless a 64-bit coincidence. Zeros add nothing (vLLM's vocabulary padding). On request (values) a group also
# carries the sum of its values: to say how large a difference is.
_WORD = 1 << 64
_BLOCK = 1 << 17  # halves a row's float64 sum takes at a time: 2^17 x 2^15 x 2^20 = 2^52 < 2^53
_M1, _M2, _GAMMA = 0xBF58476D1CE4E5B9 - _WORD, 0x94D049BB133111EB - _WORD, 0x9E3779B97F4A7C15 - _WORD
_columns = {}  # (device, dtype) -> v(c) for c < its length


def fingerprint_group(name: str) -> str:
    match = re.search(r"\.layers\.(\d+)\.", name)
    return f"layers.{match.group(1)}" if match else "rest"


def fingerprint(items, into: dict = None, values: bool = False) -> dict:
    """{group: [Σ mod 2^64] (and Σ values)} of (name, tensor) items (the whole checkpoint weight) or (name, flat part,
    index of its first element in the weight, the weight's shape), tensors in the engines' dtype, added to into: the
    fingerprints of a weight's parts add up to the whole's."""
    into = {} if into is None else into
    for name, tensor, *where in items:
        start, shape = where or (0, tensor.shape)
        cols = math.prod(shape[1:])
        flat = tensor.detach().reshape(-1)
        sums = into.setdefault(fingerprint_group(name), [0, 0.0] if values else [0])
        if not flat.numel():
            continue
        head = min((-start) % cols, flat.numel())  # a partial first row, whole rows, a partial last row
        body = (flat.numel() - head) // cols * cols
        for a, b in ((0, head), (head, head + body), (head + body, flat.numel())):
            if b > a:
                first = start + a
                width = cols if b - a >= cols else b - a
                sums[0] = (sums[0] + block_sum(name, flat[a:b].view(-1, width), first // cols, first % cols)) % _WORD
        if values:
            sums[1] += float(flat.sum(dtype=torch.float64))
    return into


def block_sum(name: str, block: torch.Tensor, row: int, col: int) -> int:
    """Σ_r a_name(row + r) Σ_c v(col's halves + c) h_rc mod 2^64 of a block of rows [k, m] of a checkpoint weight,
    its first element at (row, col)."""
    halves = block.reshape(block.shape[0], -1).view(torch.int16)
    per = halves.shape[1] // max(1, block.shape[1])
    first = col * per
    on_cpu = halves.device.type == "cpu"
    kernel = _cpu_kernel() if on_cpu and (_kernel or halves.numel() > _COMPILED_FROM) else None
    if kernel is not None:
        v = _column_weights(first + halves.shape[1], halves.device, torch.int64)[first:]
        return int(kernel(halves.contiguous().numpy(), v.numpy(), row, _name_seed(name)))
    dots = _row_dots(halves, _column_weights(first + halves.shape[1], halves.device)[first:])
    rows = torch.arange(row, row + halves.shape[0], dtype=torch.int64, device=halves.device)
    return int((_mix(rows * _GAMMA + _name_seed(name)) | 1).mul_(dots).sum()) % _WORD


def _row_dots(halves: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Σ_c v(c) h_rc of each row, exact: in float64 over blocks of at most _BLOCK halves, in chunks of rows that
    stay in a CPU's cache."""
    dots = torch.zeros(halves.shape[0], dtype=torch.int64, device=halves.device)
    chunk = max(1, (1 << 16 if halves.device.type == "cpu" else 1 << 24) // halves.shape[1])
    buffer = torch.empty(min(chunk, halves.shape[0]), min(halves.shape[1], _BLOCK), dtype=torch.float64,
                         device=halves.device)
    threads = torch.get_num_threads()
    if halves.device.type == "cpu":  # many small ops: a thread pool sharing its cores with others waits on them
        torch.set_num_threads(1)
    try:
        for c in range(0, halves.shape[1], _BLOCK):
            w = min(_BLOCK, halves.shape[1] - c)
            for r in range(0, halves.shape[0], chunk):
                part = buffer[: min(chunk, halves.shape[0] - r), :w]
                part.copy_(halves[r : r + part.shape[0], c : c + w])
                dots[r : r + part.shape[0]] += torch.mv(part, v[c : c + w]).to(torch.int64)
    finally:
        torch.set_num_threads(threads)
    return dots


_kernel = []  # [block_sum compiled for a CPU, or None where numba is missing]
# Halves in a block from which a process loads the compiled loop (about 0.5 s), then used for every block: a model of
# none so large (the tiny one) never pays for it.
_COMPILED_FROM = 1 << 17


def _cpu_kernel():
    """block_sum on a CPU as one compiled loop (numba, which vLLM requires): the same sum in uint64 arithmetic, each
    row's dot in int64 (products below 2^35, sums below 2^63 for rows under 2^28 halves: exact, so equal to the
    float64 blocks'). One pass over the halves: SmolLM2's 134.5M bf16 ones in about 0.06 s on one thread, against
    0.27 s for torch's many small ops, so the check stays a small share of a sync. None without numba."""
    if not _kernel:
        try:
            import numba
            import numpy as np
        except ImportError:
            _kernel.append(None)
        else:
            m1, m2, gamma = (np.uint64(x % _WORD) for x in (_M1, _M2, _GAMMA))

            @numba.njit(cache=True, nogil=True)
            def weighted_sum(halves, v, row, seed):
                total = np.uint64(0)
                for r in range(halves.shape[0]):
                    dot = np.int64(0)
                    for c in range(halves.shape[1]):
                        dot += np.int64(halves[r, c]) * v[c]
                    z = np.uint64(row + r) * gamma + np.uint64(seed)  # _mix, as rows * _GAMMA + seed in torch
                    z = (z ^ (z >> np.uint64(30))) * m1
                    z = (z ^ (z >> np.uint64(27))) * m2
                    z = z ^ (z >> np.uint64(31))
                    total += (z | np.uint64(1)) * np.uint64(dot)
                return total

            _kernel.append(weighted_sum)
    return _kernel[0]


def _name_seed(name: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little", signed=True)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping; >> made logical)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _M1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _M2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def _column_weights(n: int, device, dtype=torch.float64) -> torch.Tensor:
    """v(c) for c < n (at least) on the device: float64 for torch's blocks, int64 for the compiled loop."""
    key = (str(device), dtype)
    v = _columns.get(key)
    if v is None or len(v) < n:
        c = torch.arange(max(n, 2 * len(v) if v is not None else 0), dtype=torch.int64, device=device)
        v = ((((_mix(c + _GAMMA) >> 43) & ((1 << 21) - 1)) | 1) - (1 << 20)).to(dtype)  # odd, |v| < 2^20
        _columns[key] = v
    return v


def pieces_fingerprint(pieces, values: bool = False) -> dict:
    """A worker's fingerprint by piece: {"name@row:col+rows": [Σ mod 2^64] (and Σ values)} of (checkpoint name,
    block of rows [k, m], first row, first column) pieces (weight_transfer.checkpoint_pieces): which part of a
    checkpoint weight each is, so that an engine counts a part several workers hold once (workers_fingerprint)."""
    out = {}
    for name, block, row, col in pieces:
        sums = out.setdefault(f"{name}@{row}:{col}+{block.shape[0]}", [0, 0.0] if values else [0])
        sums[0] = (sums[0] + block_sum(name, block.detach(), row, col)) % _WORD
        if values:
            sums[1] += float(block.sum(dtype=torch.float64))
    return out


def workers_fingerprint(workers: list) -> dict:
    """An engine's fingerprint from its tensor-parallel workers' fingerprints by piece: a piece held by several
    workers (a norm's weight, a row-parallel layer's bias, the key/value heads vLLM replicates where the workers
    outnumber them) counts once where their sums agree; copies that disagree all count, and the check fails."""
    held = {}
    for worker in workers:
        for key, sums in worker.items():
            copies = held.setdefault(key, [])
            if sums not in copies:
                copies.append(sums)
    return add_fingerprints({fingerprint_group(key.rsplit("@", 1)[0]): sums} for key, copies in held.items()
                            for sums in copies)


def add_fingerprints(parts) -> dict:
    """The sum of several fingerprints (a trainer's ranks' partitions, an engine's tensor-parallel workers)."""
    total = {}
    for part in parts:
        for group, sums in part.items():
            into = total.setdefault(group, [0] * len(sums))
            into[0] = (into[0] + sums[0]) % _WORD
            for k in range(1, len(sums)):
                into[k] += sums[k]
    return total


def fingerprint_differences(engine: dict, trainer: dict) -> list:
    """The groups whose bit patterns differ, in the trainer's order (then any the trainer has not)."""
    return [g for g in trainer if engine.get(g, [0])[0] != trainer[g][0]] + \
           [g for g in engine if g not in trainer and engine[g][0] != 0]
