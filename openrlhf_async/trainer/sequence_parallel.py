"""Sequence parallelism (--ds.ring_attn_size N): one packed row split across N consecutive trainer ranks, each running
the model on its 1/N of the row's tokens, so that a context N times longer fits a device.

OpenRLHF splits the row the same way and runs ring attention (ring-flash-attn, CUDA only). Attention here is
DeepSpeed-Ulysses' form, which needs no kernel of its own and runs on gloo as on NCCL: an all-to-all trades the split
of the row for a split of the heads (each rank then holds every position of 1/N of the heads), each sample of the row
attends within itself through torch's sdpa (causal, no mask), and a second all-to-all trades back. The rest of a
decoder layer is per token. Any head count works: key/value heads are repeated to the query heads where they do not
divide by N, and heads are padded with zero heads to a multiple of N.

The loss stays the trainer's own: each rank's per-token log-probs are gathered along the row, so every rank of a group
computes the same loss; the gather's backward keeps each rank's own slice of the gradient, the all-to-alls carry the
rest between ranks, and DeepSpeed's average over all ranks gives the whole batch's gradient (rank.py scales the loss
by the world size). Groups are data-parallel units: the micro-batch plan deals each group the same micro batches, and
only a group's first rank reports (trainer/ranks.py)."""

import contextlib
from dataclasses import dataclass

import torch

_PREFIX = "sequence_parallel_"
_sharded_forward = False  # inside a forward over a split row: the model builds no attention mask


class SequenceGroup:
    """This rank's group of `size` consecutive ranks that share each packed row."""

    def __init__(self, rank: int, world_size: int, size: int):
        import torch.distributed as dist

        self.size, self.rank, self.group = size, rank % size, None
        for first in range(0, world_size, size):  # every rank must create every group (torch.distributed's rule)
            group = dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                self.group = group

    def split(self, ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor) -> tuple:
        """A packed row's ([1, T]) ids, positions and targets, padded to a multiple of the group's size with a
        stand-in sample of token 0: this rank's slices of them, and the row's Segments."""
        total = ids.shape[1]
        pad = -total % self.size
        if pad:
            ids = torch.nn.functional.pad(ids, (0, pad))
            targets = torch.nn.functional.pad(targets, (0, pad))
            position_ids = torch.cat([position_ids, torch.arange(pad, device=ids.device).unsqueeze(0)], 1)
        starts = (position_ids[0] == 0).nonzero().flatten().tolist()
        lengths = [b - a for a, b in zip(starts, starts[1:] + [total + pad])]
        local = (total + pad) // self.size
        piece = slice(self.rank * local, (self.rank + 1) * local)
        return ids[:, piece], position_ids[:, piece], targets[:, piece], Segments(self, tuple(lengths))

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """[1, L/N] per-position values of every rank -> [1, L], the row's; the backward keeps this rank's slice."""
        return _Gather.apply(values, self)


@dataclass(frozen=True)
class Segments:
    """What the attention of a split row needs: the group, and the row's samples' lengths (padding included). It
    travels with the forward's keyword arguments into every attention call, so a recomputed (checkpointed) layer
    finds it too."""
    group: SequenceGroup
    lengths: tuple


@contextlib.contextmanager
def sharded_forward():
    """Around a model's forward over a split row: no attention mask is built (its samples' causal attention is run
    per sample, _attention), and none of the split row's size, which would be wrong."""
    global _sharded_forward
    _sharded_forward = True
    try:
        yield
    finally:
        _sharded_forward = False


def register(base: str) -> str:
    """The name of an attention implementation (transformers' AttentionInterface) that runs a split row's attention
    across its group (a forward given `segments`) and is `base` otherwise: the name to load the model with."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = _PREFIX + base
    base_attention = ALL_ATTENTION_FUNCTIONS[base]
    base_mask = ALL_MASK_ATTENTION_FUNCTIONS[base]

    def attention(module, query, key, value, attention_mask, segments: Segments = None, **kwargs):
        if segments is None:
            return base_attention(module, query, key, value, attention_mask, **kwargs)
        return _attention(module, query, key, value, segments, **kwargs)

    def mask(*args, **kwargs):
        return None if _sharded_forward else base_mask(*args, **kwargs)

    AttentionInterface.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask)
    return name


def _attention(module, query, key, value, segments: Segments, dropout: float = 0.0, scaling=None,
               sliding_window=None, **kwargs) -> tuple:
    """Ulysses attention of this rank's slice: query [1, H, L/N, D], key and value [1, H_kv, L/N, D] -> [1, L/N, H, D]
    (transformers' attention functions' output), as full causal attention of each sample over the whole row."""
    if sliding_window is not None or kwargs.get("s_aux") is not None:
        raise ValueError("--ds.ring_attn_size: sliding-window attention and attention sinks are not built for "
                         "sequence parallelism; drop --ds.ring_attn_size for this model")
    group = segments.group
    n, heads, kv_heads = group.size, query.shape[1], key.shape[1]
    if kv_heads % n:  # repeat the shared key/value heads to every query head, which are then split alike
        key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    padded = -heads % n
    if padded:  # zero heads, so that the heads split evenly; their output is dropped below
        query, key, value = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, padded)) for t in (query, key, value))
    query, key, value = (_Exchange.apply(t.contiguous(), group, _row_to_heads) for t in (query, key, value))
    gqa = query.shape[1] != key.shape[1]
    out, start = [], 0
    for length in segments.lengths:
        piece = slice(start, start + length)
        out.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, piece], key[:, :, piece], value[:, :, piece], dropout_p=dropout, is_causal=True,
            scale=scaling, enable_gqa=gqa))
        start += length
    out = _Exchange.apply(torch.cat(out, 2).contiguous(), group, _heads_to_row)[:, :heads]
    return out.transpose(1, 2).contiguous(), None


def _all_to_all(send: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """send [N, ...]: block j goes to rank j; returns [N, ...] with block i from rank i."""
    import torch.distributed as dist

    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group.group)
    return received


def _row_to_heads(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """[B, H, L/N, D] (this rank's positions, every head) -> [B, H/N, L, D] (every position, this rank's heads)."""
    b, h, length, d = x.shape
    n = group.size
    send = x.reshape(b, n, h // n, length, d).transpose(0, 1).contiguous()
    return _all_to_all(send, group).permute(1, 2, 0, 3, 4).reshape(b, h // n, n * length, d)


def _heads_to_row(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """The inverse of _row_to_heads: [B, H/N, L, D] -> [B, H, L/N, D]."""
    b, h, length, d = x.shape
    n = group.size
    send = x.reshape(b, h, n, length // n, d).permute(2, 0, 1, 3, 4).contiguous()
    return _all_to_all(send, group).transpose(0, 1).reshape(b, n * h, length // n, d)


class _Exchange(torch.autograd.Function):
    """One of the two all-to-alls (_row_to_heads or _heads_to_row) as an autograd step: the backward is the other."""

    @staticmethod
    def forward(ctx, x, group, exchange):
        ctx.group, ctx.inverse = group, _INVERSE[exchange]
        return exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.inverse(grad.contiguous(), ctx.group), None, None


_INVERSE = {_row_to_heads: _heads_to_row, _heads_to_row: _row_to_heads}


class _Gather(torch.autograd.Function):
    """All ranks' [1, L/N] slices concatenated; the backward is this rank's slice of the gradient (every rank of the
    group computes the same loss from the gathered row, so its own slice is the whole gradient of its values)."""

    @staticmethod
    def forward(ctx, values, group):
        import torch.distributed as dist

        ctx.rank, ctx.width = group.rank, values.shape[1]
        parts = [torch.empty_like(values) for _ in range(group.size)]
        dist.all_gather(parts, values.contiguous(), group=group.group)
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width], None
