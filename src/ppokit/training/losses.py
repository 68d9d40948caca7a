"""The PPO losses, as pure functions over tensors: the clipped policy loss (token or sequence ratios, dual clip,
the decoupled objective), truncated importance weights, the clipped value loss, their aggregation over tokens and
rows and the whole `ppo_loss`; the Bradley-Terry loss of a reward model.

Every function documents the shapes it takes and returns, using B for the number of sequences, T for response tokens
and V for the vocabulary. This module imports only torch (and the other modules of the mathematics).

Loss aggregation and micro-batches (the contract `ppo_loss` keeps; batching code relies on it):

  Every loss term is  L = sum_{i,t} w_{i,t} * l_{i,t} / D.  The per-token weights w depend only
  on their own row (`token_weights`: 1 on real tokens, or 1/|o_i| for seq_mean_token_mean), and
  the normaliser D is one number for the set of rows that make one optimiser step
  (`loss_normalisers`: real tokens, sequences, or sequences x response_length). So a caller that
  computes D once over a whole minibatch, passes the same D to `ppo_loss` for every micro-batch
  of it and lets the gradients add up gets exactly the gradient of the minibatch in one piece,
  however its rows are split into micro-batches (by count or by a token budget).
  The trainer's default (TRL's) instead computes D over each micro-batch and divides each
  micro-batch's loss by the number of micro-batches: with micro-batches of equal token counts
  the two agree; otherwise the default weights a token by its micro-batch's size. With several
  processes (DDP averages gradients), a D summed over the processes' minibatches and a loss
  multiplied by the number of processes normalise over the global minibatch.
  The value loss is always a token mean (its own D: the real tokens); the policy, KL-loss and
  entropy terms use the configured aggregation.

References:
  [PPO]    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347.
  [BT]     Bradley & Terry 1952, "Rank Analysis of Incomplete Block Designs: I. The Method
           of Paired Comparisons", Biometrika 39(3/4).
  [O22]    Ouyang et al. 2022, "Training language models to follow instructions with human
           feedback", arXiv:2203.02155.
  [GRPO]   Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
           Language Models", arXiv:2402.03300 (section 4.1.2, outcome supervision).
  [DrGRPO] Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
           arXiv:2503.20783 (section 3.2: no std scaling, no 1/|o_i| length normalisation).
  [DAPO]   Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
           arXiv:2503.14476 (section 3.1 clip-higher, eps_low < eps_high; section 3.3 token-level
           loss; section 3.4 overlong filtering: the loss of truncated samples masked).
  [DC]     Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
           Learning", arXiv:1912.09729 (dual-clip PPO: for A < 0 the loss is capped at c * |A|).
  [GSPO]   Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071 (eq. 7: the
           sequence-level ratio s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|), clipped per sequence).
  [TIS]    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
           https://fengyao.notion.site/off-policy-rl (truncated importance sampling between the
           rollout engine's and the trainer's probabilities).
  [AReaL]  Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
           Reasoning", arXiv:2505.24298 (the decoupled PPO objective for stale rollouts: the ratio against a
           proximal policy, the behaviour policy corrected by an importance weight), after Hilton et al. 2022,
           "Batch size-invariance for policy optimization", arXiv:2110.00641 (decoupling the proximal policy).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ppokit.training.statistics import masked_mean
from ppokit.training.token_rewards import clamp_log_ratio, kl_per_token


LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")


class PolicyLossStats(NamedTuple):
    """Detached statistics of one policy-loss evaluation (scalars, means over real tokens)."""

    approxkl: torch.Tensor
    clipfrac: torch.Tensor
    ratio: torch.Tensor


def truncated_is_weights(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, cap: float, floor: float = 0.0) -> torch.Tensor:
    """Truncated importance weights of tokens sampled by a rollout engine whose probabilities are not the
    trainer's [TIS]: w_t = clip(pi_trainer(y_t) / pi_engine(y_t), floor, cap) = clip(exp(trainer - engine), floor, cap).

    trainer_logprobs (the old policy under the training forward), engine_logprobs (what the engine sampled
    with): (B, T) -> (B, T) float, detached (a weight, not a path for gradients). Where the two agree, 1.
    The policy-gradient loss of each token is multiplied by its weight, which corrects the gradient for
    sampling from pi_engine instead of pi_trainer; the cap bounds its variance (a token the engine found
    far less likely than the trainer does). floor 0 (the default) is one-sided truncation, veRL's token-level
    weights; OpenRLHF's `tis` clips to [0.5, 5] by default (floor 0.5, cap 5). Padding (both 0) gets 1.
    """
    return torch.exp(trainer_logprobs.detach().float() - engine_logprobs.detach().float()).clamp(min=floor, max=cap)


def truncated_is_sequence_weights(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                                  cap: float, floor: float = 0.0) -> torch.Tensor:
    """Sequence-level truncated importance weights [TIS]: one weight per response, the ratio of the whole
    response's probabilities, on each of its tokens (veRL's `rollout_is: sequence`).

    trainer_logprobs, engine_logprobs: (B, T); mask: (B, T) bool, the trained tokens -> (B, T) float, detached.
    w_i = clip(exp(clamp(sum_t mask_it (trainer_it - engine_it), -20, 20)), floor, cap) on every column of row i
    (the log-ratio sum clamped to +-LOG_RATIO_CLAMP before the exp, as veRL does). Unlike the token-level
    weights, the product over a response is an unbiased correction of the whole sequence's probability, at
    the price of a variance that grows with its length. A row without trained tokens gets 1.
    """
    log_ratio = (trainer_logprobs.detach().float() - engine_logprobs.detach().float()) * mask.to(torch.float32)
    weight = torch.exp(clamp_log_ratio(log_ratio.sum(-1, keepdim=True))).clamp(min=floor, max=cap)
    return weight.expand_as(log_ratio).contiguous()


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level log-ratio [GSPO, eq. 7], on every column of its row.

    logprobs (with grad), old_logprobs: (B, T); mask: (B, T) bool, the trained tokens -> (B, T).
    log s_i = (1/|y_i|) sum_t (logp_{i,t} - old_logp_{i,t}) over row i's masked tokens (0 for a row without any),
    the same value in each of the row's T columns: s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|), the geometric mean of the
    token ratios. Its gradient reaches every token's logprob of the row, each by 1/|y_i|.
    """
    maskf = mask.to(logprobs.dtype)
    per_row = ((logprobs - old_logprobs) * maskf).sum(-1, keepdim=True) / maskf.sum(-1, keepdim=True).clamp(min=1)
    return per_row.expand_as(logprobs)


def policy_loss_per_token(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    cliprange_low: float,
    cliprange_high: float,
    dual_clip_c: Optional[float] = None,
    sequence_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """PPO's clipped surrogate at every token, as a loss [PPO, eq. 7], with an asymmetric clip
    range [DAPO, clip-higher] and an optional dual clip [DC].

    logprobs (current policy, with grad), old_logprobs (sampling policy), advantages: (B, T)
    -> (loss (B, T), log_ratio (B, T), ratio (B, T), clipped (B, T) bool, dual_clipped (B, T) bool or None).
    l_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), r = exp(logp - old_logp) with the log-ratio
    clamped to +-LOG_RATIO_CLAMP (`clamp_log_ratio`: beyond it r = e^{+-20} and no gradient);
    with dual clip c > 1, where A < 0:  l_t = min(l_t, -A c), so a ratio far above 1 on a bad
    action cannot make the loss unbounded. `clipped` marks the tokens where the clip bound was
    taken, `dual_clipped` those where the dual clip was.
    sequence_mask: (B, T) bool, the trained tokens, for GSPO's sequence-level ratio [GSPO]: r is then each row's
    `sequence_log_ratio` exponentiated, the same on all its tokens (so is the clip); None: each token's own ratio.
    """
    log_ratio = logprobs - old_logprobs if sequence_mask is None else sequence_log_ratio(logprobs, old_logprobs, sequence_mask)
    ratio = torch.exp(clamp_log_ratio(log_ratio))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange_low, 1.0 + cliprange_high)
    loss = torch.max(unclipped, clipped)
    dual_clipped = None
    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c
        dual_clipped = (advantages < 0) & (loss > cap)
        loss = torch.where(advantages < 0, torch.min(loss, cap), loss)
    return loss, log_ratio, ratio, clipped > unclipped, dual_clipped


def decoupled_policy_loss(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                          advantages: torch.Tensor, cliprange_low: float, cliprange_high: float, cap: float,
                          floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoupled PPO loss at every token [AReaL], for episodes sampled by an older policy (the behaviour
    policy, the rollout engine's weights of some versions ago) and trained against a recent one (the proximal policy).

    logprobs (current policy, with grad), proximal_logprobs (the trainer's no-gradient forward of the weights at the
    update's start), behaviour_logprobs (what the engine sampled with), advantages: (B, T) -> (loss (B, T), the
    behaviour weights (B, T)).
        l_t = w_t * max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)),   r_t = pi(y_t) / pi_prox(y_t),
        w_t = clip(pi_prox(y_t) / pi_behav(y_t), floor, cap)                (`truncated_is_weights`, detached)
    The trust region is around the proximal policy (the clip acts on r_t, as in PPO), and the importance weight w_t
    moves the expectation from the behaviour policy to the proximal one, truncated to [floor, cap] as TIS does (AReaL's
    `behav_imp_weight_cap` drops the tokens above it instead). With proximal = behaviour (on-policy) every w_t is 1 and this is
    `policy_loss_per_token`'s loss. The trainer computes exactly this: the PPO ratio against its recomputed logprobs
    (`engines.correction.use_trainer_logprobs`) times `ppo.rollout_is`'s weights (`ppo_loss`'s is_weights).
    """
    weights = truncated_is_weights(proximal_logprobs, behaviour_logprobs, cap, floor)
    per_token = policy_loss_per_token(logprobs, proximal_logprobs, advantages, cliprange_low, cliprange_high)[0]
    return per_token * weights, weights


def _policy_stats(log_ratio: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor) -> PolicyLossStats:
    with torch.no_grad():
        return PolicyLossStats(
            approxkl=0.5 * masked_mean(log_ratio**2, mask),
            clipfrac=masked_mean(clipped.float(), mask),
            ratio=masked_mean(ratio, mask),
        )


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO's clipped surrogate objective, as a loss to minimise [PPO, eq. 7], a mean over real tokens.

    logprobs (current policy, with grad), old_logprobs (sampling policy), advantages: (B, T);
    mask: (B, T) bool, the trained tokens -> (scalar loss, PolicyLossStats).
    L = mean_t max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)), ratio = exp(logp - old_logp).
    approxkl is 0.5 * mean((logp - old_logp)^2) over real tokens, as in OpenAI's baselines
    (TRL's mean also counts padding slots, at 0).
    """
    per_token, log_ratio, ratio, clipped, _ = policy_loss_per_token(logprobs, old_logprobs, advantages, cliprange, cliprange)
    return masked_mean(per_token, mask), _policy_stats(log_ratio, ratio, clipped, mask)


def value_loss_per_token(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cliprange_value: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2) at every token, and where the clipped
    term was the larger [PPO as implemented in OpenAI baselines; N+ "value function clipping"].

    values (with grad), old_values (from the rollout), returns: (B, T) -> ((B, T), (B, T) bool).
    Inside the clip range the clipped value is V itself, bit for bit (clamp against the bounds, not
    V_old + clamp(V - V_old), whose rounding made unclipped tokens count as clipped).
    """
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_sq = (values - returns) ** 2
    clipped_sq = (clipped_values - returns) ** 2
    return torch.max(unclipped_sq, clipped_sq), clipped_sq > unclipped_sq


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss, a mean over real tokens (see `value_loss_per_token`).

    values (with grad), old_values (from the rollout), returns: (B, T); mask: (B, T) bool, the trained tokens
    -> (scalar loss, detached clip fraction).
    L = 0.5 * mean_t max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).
    """
    per_token, clipped = value_loss_per_token(values, old_values, returns, cliprange_value)
    loss = 0.5 * masked_mean(per_token, mask)
    return loss, masked_mean(clipped.float(), mask).detach()


def token_weights(mask: torch.Tensor, aggregation: str, row_share: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token weights w of an aggregation (see the module docstring): (B, T) bool -> (B, T) float32.

      token_mean, seq_mean_token_sum, seq_mean_token_sum_norm: 1 on every real token;
      seq_mean_token_mean: 1/|o_i| on the real tokens of row i (each sequence weighs the same).
    Padding is 0. Each row's weights depend on that row only, so they survive any split into
    micro-batches. row_share: (B,) float, each row's share of its episode's tokens (`segments.row_shares`; None: one
    row per episode): the sequence is the episode, seq_mean_token_mean's weight 1/|episode's tokens| = share/|o_i|.
    """
    maskf = mask.float()
    if aggregation == "seq_mean_token_mean":
        weights = maskf / maskf.sum(-1, keepdim=True).clamp(min=1)
        return weights if row_share is None else weights * row_share.to(weights.dtype).unsqueeze(1)
    if aggregation in LOSS_AGGREGATIONS:
        return maskf
    raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {aggregation!r}")


class LossNormalisers(NamedTuple):
    """The D of the module docstring for the rows of one optimiser step (0-dim float32 tensors)."""

    policy: torch.Tensor  # policy, KL-loss and entropy terms, per the configured aggregation
    value: torch.Tensor  # the value loss: the number of real tokens


def loss_normalisers(mask: torch.Tensor, aggregation: str, response_length: int, row_share: Optional[torch.Tensor] = None) -> LossNormalisers:
    """Normalisers over the rows of `mask` (B, T) bool, each at least 1.

      token_mean                 D = real tokens                 (TRL's, OpenRLHF's token-level loss) [DAPO, 3.3];
      seq_mean_token_sum         D = sequences                   (a sum over each sequence, mean over sequences);
      seq_mean_token_mean        D = sequences                   (weights 1/|o_i|: the original GRPO's mean of means) [GRPO, eq. 3];
      seq_mean_token_sum_norm    D = sequences x response_length (a constant per sequence: Dr. GRPO's) [DrGRPO, 3.2].
    Sequences count the rows with at least one real token (rows dropped from the update are none).
    `response_length` is the configured maximum, not this batch's longest response, so that D
    does not depend on what was sampled. row_share: (B,) float, each row's share of its episode's tokens
    (`segments.row_shares`; None: one row per episode): the sequences are then the episodes, the shares summed, so an
    episode of several rows counts once.
    """
    maskf = mask.float()
    tokens = maskf.sum().clamp(min=1)
    sequences = (mask.any(-1).float() if row_share is None else row_share.float()).sum().clamp(min=1)
    if aggregation == "token_mean":
        policy = tokens
    elif aggregation in ("seq_mean_token_sum", "seq_mean_token_mean"):
        policy = sequences
    elif aggregation == "seq_mean_token_sum_norm":
        policy = sequences * response_length
    else:
        raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {aggregation!r}")
    return LossNormalisers(policy=policy, value=tokens)


def aggregate(per_token: torch.Tensor, weights: torch.Tensor, normaliser: torch.Tensor) -> torch.Tensor:
    """sum_{i,t} w_{i,t} l_{i,t} / D: per_token, weights (B, T); normaliser 0-dim -> scalar."""
    return (per_token * weights.to(per_token.dtype)).sum() / normaliser


class LossSettings(NamedTuple):
    """The knobs of `ppo_loss` (the trainer builds it once from the config)."""

    cliprange_low: float = 0.2
    cliprange_high: float = 0.2
    dual_clip_c: Optional[float] = None  # None: off; else > 1
    importance_sampling_level: str = "token"  # "sequence": GSPO's ratio per response (`sequence_log_ratio`)
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0
    kl_loss_estimator: str = "k3"
    kl_clamp: Optional[float] = None  # None: off; else the per-token KL estimate is clamped to +-kl_clamp
    aggregation: str = "token_mean"


class LossTerms(NamedTuple):
    """`ppo_loss`'s result: the loss to back-propagate and detached statistics (scalars).

    A term that is off (no critic, no KL loss) is None; `dual_clipfrac` is None without dual clip.
    """

    loss: torch.Tensor
    policy: torch.Tensor
    value: Optional[torch.Tensor]
    value_clipfrac: Optional[torch.Tensor]
    kl: Optional[torch.Tensor]
    entropy: torch.Tensor
    stats: PolicyLossStats
    dual_clipfrac: Optional[torch.Tensor]


def value_loss(
    settings: LossSettings,
    normalisers: LossNormalisers,
    mask: torch.Tensor,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The value term of `ppo_loss` (before vf_coef): 0.5 * `value_loss_per_token`, a token mean over
    normalisers.value, and the share of tokens whose value was clipped (detached).

    Tensors (B, T); values with grad. A trainer that back-propagates the policy and the value terms one
    after the other (their models share no forward) adds vf_coef * this to the policy terms' loss.
    """
    value_per_token, value_clipped = value_loss_per_token(values, old_values, returns, settings.cliprange_value)
    value = 0.5 * aggregate(value_per_token, mask, normalisers.value)
    return value, masked_mean(value_clipped.float(), mask).detach()


def ppo_loss(
    settings: LossSettings,
    normalisers: LossNormalisers,
    mask: torch.Tensor,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    *,
    values: Optional[torch.Tensor] = None,
    old_values: Optional[torch.Tensor] = None,
    returns: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    is_weights: Optional[torch.Tensor] = None,
    row_share: Optional[torch.Tensor] = None,
) -> LossTerms:
    """The loss of one micro-batch: policy + vf_coef * value + kl_loss_coef * KL - entropy_coef * H.

    Tensors (B, T): mask bool, the trained tokens; logprobs (with grad), old_logprobs, advantages, entropy (with
    grad when entropy_coef > 0); values (with grad), old_values, returns: with a critic; ref_logprobs:
    with kl_loss_coef > 0; is_weights (no grad): `truncated_is_weights`, or None. normalisers: `loss_normalisers` over this micro-batch or over its whole
    minibatch (module docstring); row_share (B,): `token_weights`'s (rows of multi-segment episodes). -> LossTerms.
      policy  `policy_loss_per_token` (times is_weights token by token, when given), aggregated per `settings.aggregation`;
              with importance_sampling_level "sequence", GSPO's ratio per response [GSPO];
      value   0.5 * `value_loss_per_token`, a token mean;
      KL      `kl_per_token(logprobs, ref_logprobs, kl_loss_estimator, kl_clamp)` in the loss (k3 is the usual
              "low-variance KL" of GRPO [GRPO, eq. 4]), aggregated as the policy term;
      H       the entropy of the policy at each token, aggregated as the policy term.
    """
    weights = token_weights(mask, settings.aggregation, row_share)
    per_token, log_ratio, ratio, clipped, dual_clipped = policy_loss_per_token(
        logprobs, old_logprobs, advantages, settings.cliprange_low, settings.cliprange_high, settings.dual_clip_c,
        sequence_mask=mask if settings.importance_sampling_level == "sequence" else None,
    )
    if is_weights is not None:
        per_token = per_token * is_weights
    policy = aggregate(per_token, weights, normalisers.policy)
    loss = policy
    value = value_clipfrac = kl = None
    if values is not None:
        value, value_clipfrac = value_loss(settings, normalisers, mask, values, old_values, returns)
        loss = loss + settings.vf_coef * value
    if settings.kl_loss_coef > 0:
        kl = aggregate(kl_per_token(logprobs, ref_logprobs, settings.kl_loss_estimator, settings.kl_clamp), weights, normalisers.policy)
        loss = loss + settings.kl_loss_coef * kl
        kl = kl.detach()
    if settings.entropy_coef > 0:
        loss = loss - settings.entropy_coef * aggregate(entropy, weights, normalisers.policy)
    with torch.no_grad():
        dual_clipfrac = masked_mean(dual_clipped.float(), mask) if dual_clipped is not None else None
        return LossTerms(
            loss=loss,
            policy=policy.detach(),
            value=value.detach() if value is not None else None,
            value_clipfrac=value_clipfrac,
            kl=kl,
            entropy=masked_mean(entropy.detach(), mask),
            stats=_policy_stats(log_ratio, ratio, clipped, mask),
            dual_clipfrac=dual_clipfrac,
        )


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of the preferences under the Bradley-Terry model [BT; O22, eq. 1].

    chosen_scores, rejected_scores: (B,) reward-model scores of the preferred and the other
    completion of each pair -> scalar loss.
    P(chosen > rejected) = sigmoid(r_c - r_r);  L = -mean log sigmoid(r_c - r_r).
    Only the difference of the two scores is trained, so the scale's offset is free.
    logsigmoid keeps large negative differences finite.
    """
    return -torch.nn.functional.logsigmoid(chosen_scores.float() - rejected_scores.float()).mean()
