"""Advantages, the policy loss and the KL terms, as OpenRLHF 0.11.2 defines them (plain torch, no distributed state).

Every per-token function takes [B, T] tensors over target positions and a mask of the response tokens the model
wrote; the caller aggregates the per-token losses over the global batch (aggregate)."""

import torch

WHITENED = ("reinforce", "reinforce_baseline")  # estimators whose advantages are whitened over the batch's tokens
KL_CLAMP = 10.0  # a KL estimate per token lies in [-10, 10]
KL_IS_WEIGHT_CLIP = 10.0  # the largest importance weight of the unbiased KL-loss gradient


def group_advantages(rewards: torch.Tensor, estimator: str = "group_norm", no_std_norm: bool = False,
                     clip_range: tuple = None, lengths: torch.Tensor = None, present: torch.Tensor = None
                     ) -> torch.Tensor:
    """rewards: [groups, n]; lengths: [groups, n] response tokens the model wrote. One advantage per sample:

    rloo: r minus the mean of the group's others; reinforce_baseline and dr_grpo: r minus the group mean;
    group_norm (GRPO): (r - group mean) / (group std + 1e-9); flash_reinforce: r minus the batch mean; reinforce: r.
    Then clipped to clip_range, and for reinforce and reinforce_baseline whitened over the batch's tokens (each
    sample counts once per token; no_std_norm: centred only).
    present: [groups, n] bools for groups of different sizes padded to n: only its entries count (the others' 0)."""
    if not torch.isfinite(rewards if present is None else rewards[present]).all():  # the rollout refuses them
        raise ValueError("a reward of inf or nan reached the advantages; it would turn its group's into nan")
    p = torch.ones_like(rewards, dtype=torch.float64) if present is None else present.double()
    r = rewards.double() * p
    count = p.sum(dim=1, keepdim=True)  # a group of one has advantage r - r = 0 (a dense std would be nan)
    mean = r.sum(dim=1, keepdim=True) / count.clamp(min=1)
    if estimator == "rloo":
        adv = r - (r.sum(dim=1, keepdim=True) - r) / (count - 1).clamp(min=1)
    elif estimator in ("reinforce_baseline", "dr_grpo"):
        adv = r - mean
    elif estimator == "group_norm":
        std = (((r - mean) * p).pow(2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        adv = (r - mean) / (std + 1e-9)
    elif estimator == "flash_reinforce":
        adv = r - r.sum() / p.sum().clamp(min=1)
    elif estimator == "reinforce":
        adv = r
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    if clip_range is not None:
        adv = adv.clamp(*clip_range)
    adv = adv * p
    if estimator in WHITENED:
        weights = (torch.ones_like(adv) if lengths is None else lengths.double()).clamp(min=0) * p
        total = weights.sum().clamp(min=1)
        adv = (adv - (adv * weights).sum() / total) * p
        if not no_std_norm:
            adv = adv * ((adv.pow(2) * weights).sum() / total).clamp(min=1e-8).rsqrt()
    return adv.to(rewards.dtype)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   top_p: float = 1.0) -> torch.Tensor:
    """Log-probability of each next token: logits [B, T, V] predict tokens [B, T]. top_p < 1: under the nucleus
    distribution vLLM samples from and reports log-probs of (top_p_logits), renormalised over its kept tokens."""
    scaled = logits.float() / temperature
    if top_p < 1:
        scaled = top_p_logits(scaled, top_p, tokens)
    logp = torch.log_softmax(scaled, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def top_p_logits(logits: torch.Tensor, top_p: float, tokens: torch.Tensor) -> torch.Tensor:
    """logits [..., V] with the tokens outside each position's nucleus at -inf, by vLLM's rule (its sampler's
    top-p): in ascending order of probability, the tokens whose cumulative probability stays at or below 1 - top_p
    are dropped, the most likely one never. The chosen token (tokens [...]) is always kept: vLLM sampled it from its
    own nucleus, which the trainer's logits, rounded apart, could place a hair outside. The choice of the set is not
    differentiated; the kept logits are."""
    with torch.no_grad():
        ascending, order = logits.sort(dim=-1)
        dropped = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        dropped[..., -1] = False
        outside = torch.zeros_like(dropped).scatter_(-1, order, dropped)
        outside.scatter_(-1, tokens.unsqueeze(-1), False)
    return logits.masked_fill(outside, float("-inf"))


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The entropy of each position's next-token distribution: [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def approx_kl(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k1", old_logp: torch.Tensor = None,
              unbiased_gradient: bool = False) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) (Schulman's k1, k2, k3), clamped to [-10, 10]; k3's log-ratio is
    bounded below first so exp cannot overflow. unbiased_gradient keeps the value and back-propagates the
    importance-weighted reverse-KL gradient instead (the same for k1, k2 and k3)."""
    log_ratio = logp.float() - ref_logp.float()
    if estimator == "k1":
        value = log_ratio
    elif estimator == "k2":
        value = log_ratio.pow(2) / 2
    elif estimator == "k3":
        bounded = log_ratio.clamp(min=-KL_CLAMP)
        value = (-bounded).exp() - 1 + bounded
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}")
    value = value.clamp(-KL_CLAMP, KL_CLAMP)
    if not unbiased_gradient:
        return value
    w = 1.0 if old_logp is None else (logp.float() - old_logp.float()).exp().clamp(max=KL_IS_WEIGHT_CLIP).detach()
    surrogate = w * log_ratio.pow(2) / 2
    return value.detach() + surrogate - surrogate.detach()


def kl_reward_advantages(kl: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """The KL penalty as a per-token reward (-coef * kl at each response token), returned to each token summed
    from it to the response's end: what it adds to the token's advantage (gamma 1)."""
    penalty = -coef * kl.detach() * mask
    return penalty.flip(-1).cumsum(-1).flip(-1) * mask


def correction_weights(old_logp, rollout_logp, mask, level: str, mode: str, gating: str, threshold: tuple):
    """The train/rollout mismatch correction (OpenRLHF 0.11.2): per-token coefficient on the loss and which units
    (tokens, or whole sequences at level seq) it filtered. The statistic is the ratio pi_train / pi_rollout (per
    token, or its geometric mean per sequence), or the sampled token's binary KL / total variation between the two
    policies; mask drops units outside [low, high] (survivors keep their ratio), clip clamps the ratio into it."""
    low, high = threshold
    log_ratio = (old_logp - rollout_logp).detach()
    ratio = log_ratio.exp()
    seq = level == "seq"

    def per_sequence(x):
        return ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1)).unsqueeze(-1).expand_as(x)

    if gating == "ratio":
        stat = (per_sequence(log_ratio) if seq else log_ratio).exp()
    else:
        p, q = rollout_logp.exp().clamp(1e-6, 1 - 1e-6), old_logp.exp().clamp(1e-6, 1 - 1e-6)
        if gating == "binary_kl":
            stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
        else:
            stat = (p - q).abs()
        stat = per_sequence(stat) if seq else stat
    if mode == "clip":
        return stat.clamp(low, high), (stat < low) | (stat > high)
    keep = (stat >= low) & (stat <= high)
    return torch.where(keep, ratio, torch.zeros_like(ratio)), ~keep


def policy_loss(logp, old_logp, rollout_logp, advantages, mask, clip: tuple = (0.2, 0.2), dual_clip: float = None,
                loss_type: str = "ppo", correction: dict = None) -> dict:
    """Per-token PPO / GSPO loss (OpenRLHF 0.11.2's PolicyLoss before aggregation) and its figures as sums over the
    masked tokens. correction: {level, mode, gating, threshold} of the train/rollout mismatch correction (level off:
    none). Returns {"token_loss", "clipped", "corrected", "weight", "vllm_kl", "vllm_gap", "vllm_gap_max"}: vllm_gap
    the sum of |rollout log-prob - proximal's|, vllm_gap_max its largest."""
    correction = correction or {"level": "off"}
    on = correction["level"] != "off"
    if loss_type == "ppo":
        ratio = (logp - old_logp).clamp(-20.0, 20.0).exp()
    elif loss_type == "gspo":
        log_ratio = logp - (rollout_logp if on else old_logp)
        ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)).exp().unsqueeze(-1) * mask
    else:
        raise ValueError(f"unknown policy loss type {loss_type!r}")
    surrogate = ratio * advantages
    clipped = ratio.clamp(1 - clip[0], 1 + clip[1]) * advantages
    loss = -torch.minimum(surrogate, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    weights, corrected = torch.ones_like(loss), torch.zeros_like(loss, dtype=torch.bool)
    if on and loss_type == "ppo":
        weights, corrected = correction_weights(old_logp, rollout_logp, mask, correction["level"],
                                                correction["mode"], correction["gating"], correction["threshold"])
        loss = weights * loss
    m = mask.bool()
    gap = ((rollout_logp - old_logp) * mask).detach()
    return {"token_loss": loss, "clipped": int(((clipped < surrogate) & m).sum()), "corrected": int((corrected & m).sum()),
            "weight": float((weights * mask).sum()), "vllm_kl": float(gap.sum()), "vllm_gap": float(gap.abs().sum()),
            "vllm_gap_max": float(gap.abs().max()) if gap.numel() else 0.0}


def aggregate(token_values: torch.Tensor, mask: torch.Tensor, mode: str, global_tokens: int,
              global_sequences: int) -> torch.Tensor:
    """This micro batch's share of the batch's loss: token-mean sums over the batch's tokens, seq-mean-token-mean
    averages each sequence's token mean over the batch's sequences (one with no response tokens counts for none)."""
    if mode == "token-mean":
        return (token_values * mask).sum() / max(1, global_tokens)
    counts = mask.sum(-1)
    per_sequence = (token_values * mask).sum(-1) / (counts + 1e-8)
    return (per_sequence * (counts > 0)).sum() / max(1, global_sequences)


# ---- PPO with a critic (--algo.advantage.estimator gae) ---------------------------------------------------------

def token_rewards(rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Per-token rewards [B, T] for GAE: -kl_coef x kl at every response token the model wrote, plus the sequence's
    reward (rewards: [B]) at its last such token (OpenRLHF's compute_reward)."""
    per_token = -max(0.0, kl_coef) * kl.detach() * mask
    last = mask.shape[1] - 1 - mask.long().flip(-1).argmax(-1)
    return per_token.scatter_add(1, last.unsqueeze(1), rewards.to(per_token.dtype).unsqueeze(1))


def gae(values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lambd: float) -> tuple:
    """Generalised advantage estimates and returns, [B, T] each, from the critic's values and per-token rewards,
    back to front over the tokens the model wrote: delta_t = r_t + gamma^d V_t' - V_t, A_t = delta_t +
    gamma^d lambd A_t', t' the next such token, d positions on. An environment's tokens between them (a tool's
    output) are skipped, as in veRL and RAGEN: taken as steps of value 0 they would make delta_t = -V_t and cut the
    future off by lambd^d. gamma still counts their positions (veRL's counts the model's tokens; the same at gamma 1),
    so at lambd 1 A_t is, as before, the reward to come discounted by position minus V_t. Outside the mask both are
    0."""
    values, rewards = values.double() * mask, rewards.double() * mask
    model = mask.bool()
    advantages = torch.zeros_like(values)
    # A_t' and V_t' of the next model token, discounted to position t + 1
    running, following = torch.zeros_like(values[:, 0]), torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        a = rewards[:, t] + gamma * following - values[:, t] + gamma * lambd * running
        advantages[:, t] = torch.where(model[:, t], a, 0.0)
        running = torch.where(model[:, t], a, gamma * running)
        following = torch.where(model[:, t], values[:, t], gamma * following)
    return advantages, advantages + values


def whiten(advantages: torch.Tensor, mask: torch.Tensor, no_std_norm: bool = False) -> torch.Tensor:
    """Advantages centred (and scaled to unit variance unless no_std_norm) over the batch's masked tokens."""
    total = mask.sum().clamp(min=1)
    centred = advantages - (advantages * mask).sum() / total
    if no_std_norm:
        return centred * mask
    return centred * ((centred.pow(2) * mask).sum() / total).clamp(min=1e-8).rsqrt() * mask


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float = None):
    """Per-token clipped value loss, before aggregation: 0.5 x max((V - R)^2, (V_clipped - R)^2), where V_clipped stays
    within clip of the values the returns were computed with (no clip: 0.5 x (V - R)^2)."""
    loss = (values - returns).pow(2)
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.max(loss, (clipped - returns).pow(2))
    return 0.5 * loss


class KLController:
    """The KL coefficient: fixed, or adaptive (--algo.kl.target) as Ziegler et al. and OpenRLHF's
    AdaptiveKLController move it after each step: error = clip(kl / target - 1, -0.2, 0.2), coef *= 1 + error x
    n_steps / horizon, where n_steps is the step's samples."""

    def __init__(self, init_coef: float, target: float = None, horizon: int = 10000):
        self.value, self.target, self.horizon = init_coef, target, horizon

    def update(self, kl: float, n_steps: int) -> float:
        if self.target:
            error = min(max(kl / self.target - 1, -0.2), 0.2)
            self.value *= 1 + error * n_steps / self.horizon
        return self.value
