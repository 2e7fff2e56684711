"""The dynamic-sampling group filter (DAPO): keep a prompt's group only if its scores carry a learning signal.
It reads the episodes' scores (Episode.score: a reward source's "scores", else its rewards, as in OpenRLHF), never
the shaped rewards the advantages use. One filter decides for the batch and for screening, so a group is judged by
the same rule in both."""

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class GroupFilter:
    rule: Optional[str] = "std"  # std | mean_range (OpenRLHF's rule) | None: keep every group
    eps: float = 1e-6  # std: the scores' standard deviation must be above this
    low: float = 0.0  # mean_range: the mean must lie strictly inside (low, high)
    high: float = 1.0

    @classmethod
    def from_config(cls, algo) -> "GroupFilter":
        rule = algo.dynamic_filtering_rule if algo.dynamic_filtering_enable else None
        return cls(rule, algo.dynamic_filtering_std_eps, *algo.dynamic_filtering_range)

    def keep(self, scores: list) -> bool:
        if self.rule is None:
            return True
        if self.rule == "std":
            return not self.flat(scores)
        mean = sum(scores) / len(scores)
        return self.low + 1e-6 < mean < self.high - 1e-6

    def flat(self, scores: list) -> bool:
        """All scores equal within eps, whatever the rule: the group teaches nothing."""
        mean = sum(scores) / len(scores)
        return math.hypot(*(s - mean for s in scores)) / math.sqrt(len(scores)) <= self.eps  # hypot: no overflow
