"""Routing replay: a mixture of experts' trainer forward routes each token to the experts vLLM routed it to in the
rollout (rollout/routes.py records them), so that a token the two would route apart (a near tie between experts,
which rounding decides differently in vLLM's kernels and in the trainer's) is computed through the same experts on
both sides, and the importance correction is left with the kernels' rounding alone.

transformers' routers (Qwen3-MoE's Qwen3MoeTopKRouter, Qwen2-MoE's) return (logits, top-k weights, top-k indices)
over the flattened tokens of the forward's rows; a forward hook replaces the indices with the replayed ones wherever
the rollout's are known, and the weights with the router's own probabilities of those experts (renormalised where
the model renormalises its top-k: norm_topk_prob), so that the router still learns through them. A token without
routes (-1: its position computed by no request, or a sample with none) keeps the router's choice. The hook also
counts, replaying or not, the tokens whose top-k set differs from the rollout's: the routing mismatch each step
reports (routing/differ_share)."""

import torch

from openrlhf_async.trainer.batching import sample_length


def routers(model) -> list:
    """[(layer index, router module)] of the model's MoE layers (decoder layer `layers.{i}`'s `mlp.gate` with a
    top_k: transformers' top-k routers)."""
    found = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) >= 4 and parts[-1] == "gate" and parts[-2] == "mlp" and hasattr(module, "top_k") and (
                parts[-4] == "layers" and parts[-3].isdigit()):
            found.append((int(parts[-3]), module))
    return found


class RoutingReplay:
    """The routes of the micro batch being run, read by every router's hook (set before its forward, kept for the
    backward pass, whose recomputed layers route as the forward did), and the counts of tokens routed apart."""

    def __init__(self, model, replay: bool):
        self.replay = replay
        self.routes = None  # [tokens of the flattened rows, layers, top_k] int16, -1 unknown
        self.known = self.differ = 0
        self.hooks = [router.register_forward_hook(self._hook(layer)) for layer, router in routers(model)]

    @classmethod
    def of(cls, model, replay: bool):
        """The model's routing replay; None for a model without MoE routers."""
        made = cls(model, replay)
        return made if made.hooks else None

    def set(self, routes) -> None:
        self.routes = routes

    def take_counts(self) -> tuple:
        """(tokens with the rollout's routes, of them routed to another expert set by the trainer) since the last
        call, summed over the MoE layers."""
        counts, (self.known, self.differ) = (self.known, self.differ), (0, 0)
        return counts

    def _hook(self, layer: int):
        def hook(module, args, output):
            if self.routes is None or not isinstance(output, tuple) or len(output) != 3:
                return None
            logits, weights, indices = output
            given = self.routes[:, layer].to(indices.device, torch.long)
            if given.shape[0] != indices.shape[0]:  # not this micro batch's rows (a stand-in forward)
                return None
            known = (given >= 0).all(-1)
            if torch._C._current_graph_task_id() == -1:  # not a layer recomputed in the backward pass: counted once
                with torch.no_grad():
                    own, theirs = indices.sort(-1).values, given.to(indices.dtype).sort(-1).values
                    self.known += int(known.sum())
                    self.differ += int(((own != theirs).any(-1) & known).sum())
            if not self.replay or not bool(known.any()):
                return None
            chosen = torch.where(known.unsqueeze(-1), given.to(indices.dtype), indices)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            picked = probs.gather(-1, chosen)
            if getattr(module, "norm_topk_prob", False):
                picked = picked / picked.sum(-1, keepdim=True)
            return logits, picked.to(weights.dtype), chosen
        return hook


def layout_routes(samples: list, width: int, packed: bool, layers: int, top_k: int):
    """The samples' routes laid out as the forward's flattened tokens ([rows x width, layers, top_k] int16, -1
    unknown): one row per sample right-padded to width, or (packed) one row of them all. None when no sample has
    routes."""
    if not any(s.get("routes") is not None for s in samples):
        return None
    lengths = [sample_length(s) for s in samples]
    rows = 1 if packed else len(samples)
    out = torch.full((rows * (sum(lengths) if packed else width), layers, top_k), -1, dtype=torch.int16)
    start = 0
    for i, (s, n) in enumerate(zip(samples, lengths)):
        begin = start if packed else i * width
        if s.get("routes") is not None:
            r = torch.as_tensor(s["routes"][:n], dtype=torch.int16)
            out[begin : begin + r.shape[0]] = r
        start += n
    return out
