"""How a rank's samples become forward passes, and the log-probs a pass yields.

Micro batches hold a fixed number of samples (--train.micro_batch_size) or, with --train.dynamic_batch_enable, as
many as fit a token budget (--train.max_tokens_per_gpu). A micro batch is either padded rows, one per sample, or
one packed row (--ds.packing_samples) whose samples restart their positions at 0, so that attention stays inside
each sample (transformers reads the packing from the position ids: sdpa on CPU, flash attention on GPU).
Whatever the layout, the log-probs come back as one right-padded row per sample, so the loss never sees it."""

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from openrlhf_async.trainer.losses import token_entropy, token_logprobs


def sample_length(sample: dict) -> int:
    return len(sample["prompt_ids"]) + len(sample["response_ids"])


def shard(lengths: list, ranks: int, balanced: bool) -> list:
    """Sample indices per rank: round robin, or (balanced) longest first onto the rank with the fewest tokens, so
    that ranks that wait for each other at every ZeRO-3 gather carry about the same work."""
    if not balanced:
        return [list(range(r, len(lengths), ranks)) for r in range(ranks)]
    shards, loads = [[] for _ in range(ranks)], [0] * ranks
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = loads.index(min(loads))
        shards[r].append(i)
        loads[r] += lengths[i]
    return [sorted(s) for s in shards]


def micro_batches(lengths: list, size: int, max_tokens: Optional[int] = None, packed: bool = False) -> list:
    """Index lists of the micro batches: `size` samples each in order, or (max_tokens) first-fit decreasing into
    batches whose cost stays within the budget: their tokens when packed, rows x longest row when padded. A
    sample over the budget alone makes a batch."""
    if max_tokens is None:
        return [list(range(k, min(k + size, len(lengths)))) for k in range(0, len(lengths), size)]
    batches, costs = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        for b, batch in enumerate(batches):
            # Longest first: a padded batch's rows are as long as its first sample.
            cost = costs[b] + n if packed else (len(batch) + 1) * lengths[batch[0]]
            if cost <= max_tokens:
                batch.append(i)
                costs[b] = cost
                break
        else:
            batches.append([i])
            costs.append(n)
    return batches


def plan(samples: list, ranks: int, size: int, max_tokens: Optional[int], packed: bool) -> list:
    """Per rank, its micro batches as lists of sample indices, the same number on every rank (a rank with fewer
    gets empty ones: ZeRO-3 gathers parameters collectively at every forward)."""
    lengths = [sample_length(s) for s in samples]
    per_rank = []
    for indices in shard(lengths, ranks, balanced=max_tokens is not None):
        local = micro_batches([lengths[i] for i in indices], size, max_tokens, packed)
        per_rank.append([[indices[j] for j in batch] for batch in local])
    count = max(1, max(len(batches) for batches in per_rank))
    return [batches + [[] for _ in range(count - len(batches))] for batches in per_rank]


@dataclass
class Layout:
    """The model's input for a micro batch and the way back to one row per sample.

    ids [R, L]; attention_mask for padded rows (None when packed); position_ids when packed (None when padded);
    gather [B, T] indexes the flattened [R, L - 1] target positions of each sample's T = longest sample - 1 targets;
    valid [B, T] marks the real ones."""
    ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    position_ids: Optional[torch.Tensor]
    gather: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of(cls, samples: list, packed: bool) -> "Layout":
        seqs = [s["prompt_ids"] + s["response_ids"] for s in samples]
        longest = max(len(q) for q in seqs)
        targets = torch.arange(longest - 1)
        valid = torch.stack([targets < len(q) - 1 for q in seqs])
        if packed:
            ids = torch.tensor([[t for q in seqs for t in q]])
            position_ids = torch.cat([torch.arange(len(q)) for q in seqs]).unsqueeze(0)
            starts = torch.tensor([0] + [len(q) for q in seqs[:-1]]).cumsum(0)
            # A packed row of T tokens has T - 1 targets; sample i's start at its first token's offset.
            gather = (starts.unsqueeze(1) + targets).clamp(max=ids.shape[1] - 2)
            return cls(ids, None, position_ids, gather, valid)
        ids = torch.zeros(len(seqs), longest, dtype=torch.long)
        mask = torch.zeros(len(seqs), longest, dtype=torch.long)
        for i, q in enumerate(seqs):
            ids[i, : len(q)] = torch.tensor(q)
            mask[i, : len(q)] = 1
        gather = torch.arange(len(seqs)).unsqueeze(1) * (longest - 1) + targets
        return cls(ids, mask, None, gather, valid)

    def to(self, device) -> "Layout":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Layout(*(move(t) for t in (self.ids, self.attention_mask, self.position_ids, self.gather, self.valid)))

    def per_sample(self, values: torch.Tensor) -> torch.Tensor:
        """[R, L - 1] values at target positions -> [B, T], one right-padded row per sample (zeros past its end)."""
        return values.reshape(-1)[self.gather] * self.valid


def _plain_head(model) -> bool:
    """Whether the model's logits are its output layer (a linear layer) applied to the last hidden states and
    nothing more (no soft-capping or scaling), so that they can be computed a chunk of positions at a time."""
    config = model.config
    return (isinstance(model.get_output_embeddings(), torch.nn.Linear)
            and not getattr(config, "final_logit_softcapping", None)
            and getattr(config, "logit_scale", 1.0) in (None, 1.0)
            and getattr(config, "logits_scaling", 1.0) in (None, 1.0))


def _logprobs_of_logits(logits, targets, temperature: float, entropy: bool, top_p: float = 1.0) -> tuple:
    """(the targets' log-probs,) and, with entropy, the distributions' entropies too (of the whole distribution)."""
    picked = token_logprobs(logits, targets, temperature, top_p)
    return (picked, token_entropy(logits, temperature)) if entropy else (picked,)


@contextlib.contextmanager
def _head_yields_logprobs(head: torch.nn.Linear, targets, temperature: float, chunk: int, entropy: bool,
                          top_p: float = 1.0):
    """For one forward pass, the output layer returns [R, L, 1 or 2]: each position's target log-prob (and
    entropy), from the logits of `chunk` positions at a time, recomputed in the backward pass rather than kept.
    It stays the layer's own forward, so ZeRO-3 gathers its (possibly tied) weight around it and the backward, as
    for the logits; computed beside the model instead, DeepSpeed would never see the backward start."""

    def forward(hidden):
        flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)

        def piece(h, t):
            return _logprobs_of_logits(torch.nn.functional.linear(h, head.weight, head.bias), t, temperature,
                                       entropy, top_p)

        parts = []
        for k in range(0, len(flat_targets), chunk):
            h, t = flat_hidden[k : k + chunk], flat_targets[k : k + chunk]
            grad = torch.is_grad_enabled() and h.requires_grad
            parts.append(torch.utils.checkpoint.checkpoint(piece, h, t, use_reentrant=False) if grad else piece(h, t))
        return torch.stack([torch.cat(column) for column in zip(*parts)], -1).view(*hidden.shape[:-1], -1)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def row_inputs(layout: Layout, sequence=None) -> tuple:
    """The model's keyword arguments for a micro batch, each position's target (position t predicts token t + 1; the
    last position a stand-in), the forward's context, and `finish`: [R, positions] values -> [R, L - 1], the target
    positions'. With sequence (a sequence_parallel.SequenceGroup; a packed layout) this rank's slice of the row, whose
    values `finish` gathers along it."""
    from openrlhf_async.trainer.sequence_parallel import sharded_forward

    ids, position_ids = layout.ids, layout.position_ids
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    extra, context = {}, contextlib.nullcontext()
    if sequence is not None:
        ids, position_ids, targets, extra["segments"] = sequence.split(ids, position_ids, targets)
        context = sharded_forward()
    # No KV cache: a training forward needs none, and transformers reads the packing only without one.
    inputs = dict(input_ids=ids, attention_mask=layout.attention_mask, position_ids=position_ids, use_cache=False,
                  **extra)
    width = layout.ids.shape[1] - 1

    def finish(values: torch.Tensor) -> torch.Tensor:
        return (values if sequence is None else sequence.gather(values))[:, :width]

    return inputs, targets, context, finish


def target_logprobs(model, layout: Layout, temperature: float, chunk: int = 0, entropy: bool = False,
                    top_p: float = 1.0, sequence=None):
    """Log-probs of each sample's next tokens under `model` (an HF causal LM, or a DeepSpeed engine around one), one
    right-padded row per sample ([B, T]), and their distributions' entropies (None unless asked). top_p < 1: of the
    nucleus distribution the rollout sampled from (losses.top_p_logits). sequence: the row split across this rank's
    sequence-parallel group (row_inputs).

    chunk > 0: the logits of `chunk` positions at a time, so that a micro batch never holds its whole
    vocabulary-wide fp32 logits (at 8B, about 2 MB per token)."""
    module = getattr(model, "module", model)
    inputs, targets, context, finish = row_inputs(layout, sequence)
    with context:
        if chunk <= 0 or not _plain_head(module):
            out = _logprobs_of_logits(model(**inputs).logits, targets, temperature, entropy, top_p)
        else:
            with _head_yields_logprobs(module.get_output_embeddings(), targets, temperature, chunk, entropy, top_p):
                out = model(**inputs).logits.unbind(-1)
    out = [finish(o) for o in out]
    return layout.per_sample(out[0]), (layout.per_sample(out[1]) if entropy else None)
