"""The metrics of one update, each decided once: what it averages over and how processes combine.

Every mean is over the episodes kept in the update (rows dropped by reward.on_error=skip count in
none) or over their trained tokens, and every process's sums are added in one reduction
(`reduce_sum`, the identity on one process) before dividing, so that N processes report what one
process would over the same episodes. Names follow TRL's PPOTrainer (docs/metrics.md).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from ppokit.training.statistics import explained_variance, pass_at_k
from ppokit.training.token_rewards import distillation_rewards
from ppokit.training.episodes import Episodes

ReduceSum = Callable[[torch.Tensor], torch.Tensor]


def objective_metrics(
    episodes: Episodes, kl: torch.Tensor, non_score: torch.Tensor, kept: torch.Tensor, kl_coef: float, reduce_sum: ReduceSum
) -> dict[str, float]:
    """objective/* and val/num_eos_tokens: per-episode means (sums over tokens within an episode), and
    objective/scores_std, the spread of the scores within the update (population std over its episodes); with a
    teacher `teacher/kl` (`teacher_kl`).

    kl, non_score: (B, R) per-token KL and KL penalty; kept: (B,) bool. Token sums are over the trained
    tokens (`Episodes.trained_mask`: none on a dropped row); with an agent's segment rows, an episode's over all its
    rows, counted once (`Episodes.is_episode`).
    """
    mask = episodes.trained_mask
    kept = kept & episodes.is_episode
    keep = kept.float()
    baseline = episodes.baseline_scores  # ReMax: the greedy responses' scores
    sums = reduce_sum(torch.stack([
        keep.sum(),
        kl.sum(),
        (-episodes.logprobs * mask).sum(),
        non_score.sum(),
        (episodes.scores * keep).sum(),
        mask.sum().float(),
        (episodes.ended & kept).sum().float(),
        (episodes.scores.square() * keep).sum(),
        (baseline * keep).sum() if baseline is not None else keep.new_zeros(()),
    ]))
    kept_episodes, kl_sum, neg_logprob_sum, non_score_total, score_sum, tokens, ended, score_sq_sum, baseline_sum = sums.tolist()
    n = max(kept_episodes, 1.0)
    estimator = {}
    if baseline is not None:
        estimator["objective/baseline_scores"] = baseline_sum / n
    if episodes.returns is not None:  # a critic: how much of the returns' variance its values explain (its own reductions)
        estimator["val/explained_variance"] = explained_variance(episodes.values, episodes.returns, mask, reduce_sum).item()
    if episodes.teacher_logprobs is not None:  # on-policy distillation: the mean per-token reverse KL to the teacher
        estimator["teacher/kl"] = teacher_kl(episodes, reduce_sum)
    return {
        "objective/scores": score_sum / n,
        "objective/scores_std": math.sqrt(max(score_sq_sum / n - (score_sum / n) ** 2, 0.0)),
        "objective/kl": kl_sum / n,
        "objective/entropy": neg_logprob_sum / n,
        "objective/non_score_reward": non_score_total / n,
        "objective/rlhf_reward": (score_sum + non_score_total) / n,
        "objective/kl_coef": kl_coef,
        "objective/response_length": tokens / n,
        "val/num_eos_tokens": int(ended),
        **estimator,
    }


def teacher_kl(episodes: Episodes, reduce_sum: ReduceSum) -> float:
    """`teacher/kl`: log pi_student - log pi_teacher of the sampled tokens (`token_rewards.distillation_rewards`), a mean over the
    trained tokens of every process: a one-sample estimate of the per-token KL(student || teacher)."""
    mask = episodes.trained_mask
    reverse_kl = distillation_rewards(episodes.logprobs, episodes.teacher_logprobs, mask, 1.0)[1]
    total, tokens = reduce_sum(torch.stack([reverse_kl.sum().float(), mask.sum().float()])).tolist()
    return total / max(tokens, 1.0)


# Training statistics (keys of `optimise.micro_batch_backward`'s stats) -> their metric names.
TRAINING_METRICS = {
    "approxkl": "policy/approxkl_avg",
    "clipfrac": "policy/clipfrac_avg",
    "pg_loss": "loss/policy_avg",
    "vf_loss": "loss/value_avg",
    "vf_clipfrac": "val/clipfrac_avg",
    "entropy": "policy/entropy_avg",
    "ratio": "val/ratio",
    "kl_loss": "loss/kl_avg",  # ppo.kl_loss_coef > 0: the KL term of the loss, before its coefficient
    "dual_clipfrac": "policy/dual_clipfrac_avg",  # ppo.dual_clip_c: share of tokens whose loss the dual clip capped
}


def training_metrics(stats: dict[str, list[torch.Tensor]], has_tokens: list[torch.Tensor], reduce_sum: ReduceSum) -> dict[str, float]:
    """Means over the micro-batches that had real tokens, on every process together, and
    val/ratio_var, the unbiased variance of the micro-batch ratios (as torch.var computes it).

    stats: statistic -> one scalar per micro-batch; has_tokens: one bool per micro-batch.
    A statistic without a metric name in TRAINING_METRICS is reported as `train/<statistic>`.
    """
    names = list(stats)
    per_micro_batch = torch.stack([torch.stack(stats[k]).float() for k in names])  # (statistics, micro-batches)
    weight = torch.stack(has_tokens).float()
    ratio = per_micro_batch[names.index("ratio")]
    sums = reduce_sum(torch.cat([(per_micro_batch * weight).sum(1), (ratio**2 * weight).sum().reshape(1), weight.sum().reshape(1)]))
    *totals, ratio_sq, count = sums.tolist()
    mean = {k: t / max(count, 1) for k, t in zip(names, totals)}
    ratio_var = max(ratio_sq - count * mean["ratio"] ** 2, 0.0) / (count - 1) if count > 1 else 0.0
    return {**{TRAINING_METRICS.get(k, f"train/{k}"): v for k, v in mean.items()}, "val/ratio_var": ratio_var}


EPISODE_METRICS = ("rollout/turns", "rollout/model_tokens", "rollout/observation_tokens", "rollout/truncated", "env/done_rate")


def episode_metrics(episodes: Episodes, reduce_sum: Optional[ReduceSum] = None) -> dict[str, float]:
    """EPISODE_METRICS of episodes with an environment: means per episode over this batch's episodes, or with
    `reduce_sum` (a sum over processes) every process's, the sums and the count added in one reduction before dividing."""
    columns = (episodes.turns, episodes.model_tokens, episodes.observation_tokens, episodes.truncated, episodes.done)
    sums = torch.stack([c.sum() for c in columns] + [torch.tensor(len(episodes), device=episodes.turns.device)]).to(torch.float64)
    if reduce_sum is not None:
        sums = reduce_sum(sums)
    *totals, n = sums.tolist()
    return {name: total / max(n, 1.0) for name, total in zip(EPISODE_METRICS, totals)}


def environment_metrics(episodes: Episodes, names: list[str], scores: torch.Tensor, valid: torch.Tensor,
                        reduce_sum: Optional[ReduceSum] = None) -> dict[str, float]:
    """Per environment, when rows choose among several (`names`, `Episodes.environments`): `env/<name>/episodes`, how
    many of the update's episodes (every process's) it played, and means over them: `turns`, `done_rate`, `reward` (its
    own reward, steps and get_reward, over the episodes that did not fail) and `score` (the combined score, over the rows
    in the update); a mean is left out when it has nothing to average. One reduction for every process's sums."""
    if not names or episodes.environments is None:
        return {}
    device = episodes.turns.device
    rewards, scores, valid = episodes.environment_rewards.to(device), scores.to(device).double(), valid.to(device)
    columns = []
    for name in names:
        mine = torch.tensor([e == name for e in episodes.environments], dtype=torch.bool, device=device)
        scored, counted = mine & ~torch.isnan(rewards), mine & valid
        columns += [mine.sum(), (episodes.turns * mine).sum(), (episodes.done & mine).sum(), scored.sum(),
                    torch.where(scored, rewards, 0.0).sum(), counted.sum(), torch.where(counted, scores, 0.0).sum()]
    sums = torch.stack([c.to(torch.float64) for c in columns])
    if reduce_sum is not None:
        sums = reduce_sum(sums)
    out: dict[str, float] = {}
    for name, (n, turns, done, n_scored, reward, n_counted, score) in zip(names, sums.view(len(names), 7).tolist()):
        out[f"env/{name}/episodes"] = int(n)
        if n:
            out[f"env/{name}/turns"], out[f"env/{name}/done_rate"] = turns / n, done / n
        if n_scored:
            out[f"env/{name}/reward"] = reward / n_scored
        if n_counted:
            out[f"env/{name}/score"] = score / n_counted
    return out


def pass_at_k_metrics(scores: list[Optional[float]], samples_per_prompt: int, ks: list[int], threshold: float) -> dict[str, float]:
    """`eval/pass@k` for each k of `ks` and `eval/mean@n` over eval samples: `scores` holds n = `samples_per_prompt`
    adjacent entries per prompt (None: unscored, which counts as not correct and in no mean). A sample is correct
    when its score is >= `threshold`; pass@k is `statistics.pass_at_k` (Chen et al. 2021, unbiased) averaged over the prompts;
    mean@n the mean score of each prompt's scored samples averaged over the prompts with one. {} without ks."""
    if not ks:
        return {}
    n = samples_per_prompt
    if len(scores) % n:
        raise ValueError(f"{len(scores)} eval scores are not {n} per prompt")
    groups = [scores[i:i + n] for i in range(0, len(scores), n)]
    correct = torch.tensor([sum(s is not None and s >= threshold for s in group) for group in groups])
    drawn = torch.full_like(correct, n)
    means = [sum(scored) / len(scored) for scored in ([s for s in group if s is not None] for group in groups) if scored]
    metrics = {f"eval/pass@{k}": pass_at_k(drawn, correct, k).mean().item() for k in ks}
    if means:
        metrics[f"eval/mean@{n}"] = sum(means) / len(means)
    return metrics


AGENT_METRICS = ("agent/calls", "agent/segments", "agent/retokenized_share", "agent/trained_share")


def agent_metrics(episodes: Episodes, reduce_sum: Optional[ReduceSum] = None) -> dict[str, float]:
    """An agent program's episodes (`Episodes.agent_numbers`): AGENT_METRICS, means per episode over every process's
    episodes (with `reduce_sum`), and the agent's own numbers (`agent/<key>` of its returned dict), means over this
    process's episodes that returned them (their keys are the agent's: they may differ between processes)."""
    numbers = episodes.agent_numbers or []
    sums = torch.tensor([[row.get(name, 0.0) for name in AGENT_METRICS] + [1.0] for row in numbers] or [[0.0] * (len(AGENT_METRICS) + 1)],
                        dtype=torch.float64, device=episodes.query_ids.device).sum(0)
    if reduce_sum is not None:
        sums = reduce_sum(sums)
    *totals, n = sums.tolist()
    metrics = {name: total / max(n, 1.0) for name, total in zip(AGENT_METRICS, totals)}
    own = sorted({key for row in numbers for key in row if key not in AGENT_METRICS})
    for key in own:
        values = [row[key] for row in numbers if key in row]
        metrics[key] = sum(values) / len(values)
    return metrics


def eval_metrics(scores: list[float], lengths: list[int], ended: list[bool]) -> dict[str, float]:
    """`PPOTrainer.evaluate`'s metrics over the scored eval episodes (one entry of each list per episode; at least
    one): eval/scores, eval/response_length (trained tokens), eval/ended (share that produced the stop token),
    eval/num_scored."""
    return {
        "eval/scores": sum(scores) / len(scores),
        "eval/response_length": sum(lengths) / len(lengths),
        "eval/ended": sum(ended) / len(ended),
        "eval/num_scored": len(scores),
    }
