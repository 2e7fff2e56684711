"""Advantages and the clipped policy-gradient loss (plain torch, no distributed state)."""

import torch


def group_advantages(rewards: torch.Tensor, estimator: str = "group_norm", no_std_norm: bool = False) -> torch.Tensor:
    """rewards: [groups, n]. Returns one advantage per sample, same shape.

    group_norm (GRPO): (r - group mean) / group std; dr_grpo: r - group mean (no std, no length bias);
    reinforce_baseline (REINFORCE++ with baseline): r - group mean, then whitened over the whole batch."""
    if not torch.isfinite(rewards).all():  # the rollout refuses such rewards: one here is a bug, not a sample
        raise ValueError("a reward of inf or nan reached the advantages; it would turn its group's into nan")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if estimator == "group_norm":
        if no_std_norm:
            return centred
        return centred / (rewards.std(dim=1, keepdim=True) + 1e-6)
    if estimator == "dr_grpo":
        return centred
    if estimator == "reinforce_baseline":
        return (centred - centred.mean()) / (centred.std() + 1e-6)
    raise ValueError(f"unknown advantage estimator {estimator!r}")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each next token: logits [B, T, V] predict tokens [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def importance_weights(old_logp, behaviour_logp, correction: str = "tis", clamp: float = 2.0,
                       band: tuple = (0.5, 2.0)):
    """Per-token weight correcting for tokens sampled by the rollout engine (behaviour policy, its logprobs as
    vLLM returned them) rather than the trainer's policy: w = pi_old / pi_behaviour, then
    tis: truncated at `clamp`; icepop: kept inside `band` and zero (token masked) outside; none: 1.
    Returns (weights, tokens truncated or masked)."""
    w = torch.exp((old_logp - behaviour_logp).detach())
    if correction == "tis":
        return w.clamp(max=clamp), w > clamp
    if correction == "icepop":
        inside = (w >= band[0]) & (w <= band[1])
        return torch.where(inside, w, torch.zeros_like(w)), ~inside
    if correction == "none":
        return torch.ones_like(w), torch.zeros_like(w, dtype=torch.bool)
    raise ValueError(f"unknown off-policy correction {correction!r}")


def policy_loss(logp, old_logp, behaviour_logp, advantages, mask, eps_low: float, eps_high: float,
                correction: str = "tis", clamp: float = 2.0, band: tuple = (0.5, 2.0), ref_logp=None,
                kl_coef: float = 0.0) -> dict:
    """Token-level DAPO/GRPO loss, summed over the masked tokens (the caller divides by the global token count).

    Decoupled PPO: the ratio pi / pi_old is clipped to [1 - eps_low, 1 + eps_high] (clip-higher), and each token
    is weighted by the off-policy correction of pi_old against the behaviour policy. With ref_logp and kl_coef,
    adds the k3 estimate of KL(pi || pi_ref). Returns sums: loss, clipped, corrected (truncated or masked) tokens,
    importance weight and KL."""
    ratio = torch.exp(logp - old_logp)
    surrogate = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    weights, corrected = importance_weights(old_logp, behaviour_logp, correction, clamp, band)
    token_loss = -torch.minimum(surrogate, clipped) * weights
    kl = torch.zeros_like(logp)
    if ref_logp is not None and kl_coef > 0:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1
        token_loss = token_loss + kl_coef * kl
    m = mask.bool()
    return {"loss": (token_loss * mask).sum(), "clipped": int(((surrogate != clipped) & m).sum()),
            "corrected": int((corrected & m).sum()), "weight": float((weights * mask).sum()),
            "kl": float((kl.detach() * mask).sum())}
