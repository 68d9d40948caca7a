"""The stages of one update between sampling and optimising, as functions of what each reads: the episodes
and the models, sizes and settings they name, never the trainer or the whole config, so that a loop that
samples ahead of training (or a test) can call them as `PPOTrainer.step` does (stages 2-5 of its list).

    score                  the reward sources on each episode's prompt + completion -> `Scored`: scores (B,), valid (B,), ...
    reference_and_values   one no-gradient pass: reference logprobs, values, the policy's own logprobs, a teacher's logprobs
    rewards                per-token KL penalty, a teacher's reverse KL, the score at each score position, per-turn rewards,
                           whitening
    with_scores            the scores on the episodes; an agent's earlier segments made rows of their own
    advantages             the estimator's advantages and returns over the trained tokens (over each episode's rows together)
    trained_on             the episodes as the optimisation sees them (truncated ones out, ppo.mask_truncated_completions)

Every per-token result is (B, R), 0 outside the episodes' `trained_mask`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, ContextManager, Optional, Sequence

import torch
from torch import nn

from ppokit.models import adapters

from ppokit.errors import UserError
from ppokit.training import algo, batching, segments
from ppokit.training.episodes import Episodes, with_segment_rows
from ppokit.training.estimators import Estimator
from ppokit.metrics.values import agent_metrics, environment_metrics, episode_metrics
from ppokit.models.forwards import Layout, eval_mode, response_logprobs
from ppokit.training.optimise import PolicyAndValue
from ppokit.rewards import ScoringBatch, completion_token_ids

Reduce = Callable[[torch.Tensor], torch.Tensor]
Autocast = Callable[[], ContextManager]


@dataclasses.dataclass
class Scored:
    """What stage 2 found for B episodes."""

    scores: torch.Tensor  # (B,) float, the reward sources' combined score
    valid: torch.Tensor  # (B,) bool, False where a source failed under reward.on_error=skip (the row leaves the update)
    errors: list[str]  # the first message of each failed source
    completions: list[str]  # everything after each prompt, decoded (with an environment: every turn and observation)
    metrics: dict[str, float]  # reward/*, and with an environment rollout/* and env/*
    sources: dict[str, torch.Tensor]  # each reward source's raw score (B,), before weights and normalisation; NaN: none


def score(scorer, tokenizer, episodes: Episodes, prompts: list[str], columns: dict, *, stop_token_ids: tuple[int, ...],
          device: torch.device, update_statistics: bool = True, all_reduce: Optional[Reduce] = None,
          environments: Sequence[str] = ()) -> Scored:
    """The reward sources (`scorer`) on each episode's prompt and completion, scores and valid on `device`.

    The completion is everything after the prompt (with an environment: every turn and observation), decoded
    by the policy's `tokenizer`; the environment's summed rewards and failures reach its reward source from the
    episodes. update_statistics=False (evaluation, a greedy baseline) leaves the scorer's reward normalisation
    where it was. all_reduce sums the episode metrics' parts over processes (None: one process). environments: the
    names rows choose their environment among (several in one run), each with its `env/<name>/*` metrics."""
    completions = tokenizer.batch_decode(
        episodes.response_ids.masked_fill(~episodes.attention_mask[:, episodes.query_ids.shape[1]:], tokenizer.pad_token_id),
        skip_special_tokens=True,
    )
    environment = episodes.environment_rewards is not None
    batch = ScoringBatch(
        prompts, completions, columns, episodes.input_ids, episodes.attention_mask.long(), tokenizer,
        completion_ids=completion_token_ids(episodes.response_ids, episodes.loss_mask, stop_token_ids),
        ended=episodes.ended.cpu() if stop_token_ids else None,
        environment_rewards=episodes.environment_rewards.tolist() if environment else None,
        environment_errors=list(episodes.environment_errors) if environment else None,
    )
    result = scorer.score(batch, update_statistics)
    metrics = {**(episode_metrics(episodes, all_reduce) if environment else {}),
               **(agent_metrics(episodes, all_reduce) if episodes.agent_numbers is not None else {}), **scorer.metrics(result),
               **environment_metrics(episodes, list(environments), result.scores, result.valid, all_reduce)}
    return Scored(result.scores.to(device), result.valid.to(device), result.errors, completions, metrics, result.raw)


@torch.inference_mode()
def reference_and_values(episodes: Episodes, model: PolicyAndValue, ref_model: Optional[nn.Module], *, rows: int, packed: bool,
                         temperature: float, chunk_size: Optional[int], autocast: Autocast = contextlib.nullcontext,
                         policy_logprobs: bool = False, teacher: Optional[nn.Module] = None, padding_free: Optional[Layout] = None,
                         ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """-> (reference logprobs, values, the policy's own logprobs, the teacher's logprobs), each (B, R) over the trained
    tokens. teacher: the frozen teacher of on-policy distillation, scored as an own reference is (`forward_logprobs`,
    the same chunks, temperature and no gradient); None: its logprobs are None.

    model: the policy and critic (unwrapped), values None without a critic; ref_model: the frozen reference, None
    for the LoRA policy's base (`reference_logprobs`). Chunks of `rows` rows (ppo.local_rollout_forward_batch_size);
    `packed` (a token budget, ppo.max_tokens_per_micro_batch): that many rows of the batch's width in tokens, rows of
    similar length together, packed (`batching.split`). temperature, chunk_size: as the training forward
    (ppo.temperature, lm_head_chunk_size); autocast: the mixed-precision context. policy_logprobs: also the policy's
    own (a rollout engine whose logprobs are not the trainer's), else None. padding_free: every forward's layout
    (`models.hidden_states`; None: the model's own, `PolicyAndValue.padding_free`): True (ppo.padding_free) packed rows
    (`models.packing`), the budget filling them (`batching.split`); a `models.prefix.SharedPrefix` (ppo.shared_prompt)
    a group's prompt once, over chunks of whole groups."""
    padding_free = model.padding_free if padding_free is None else padding_free
    budget = batching.forward_budget(episodes, rows) if packed else None
    ref_logprobs, values, logprobs, teacher_logprobs = [], [], [], []
    with model.critic_in_eval_mode(), eval_mode(model.policy):
        rows_of = torch.arange(len(episodes), device=episodes.query_ids.device)
        for index, mb in batching.split(episodes, rows_of, rows, budget, padding_free is True):
            inputs = (mb.input_ids, mb.attention_mask, mb.response_ids, mb.trained_mask)
            head = dict(temperature=temperature, chunk_size=chunk_size, autocast=autocast, padding_free=padding_free)
            ref_logprobs.append((index, reference_logprobs(model.policy, ref_model, *inputs, **head), mb.trained_mask))
            if teacher is not None:
                teacher_logprobs.append((index, forward_logprobs(teacher, *inputs, **head), mb.trained_mask))
            if policy_logprobs:  # the PPO ratio's and the KL's old logprobs: the training forward's
                logprobs.append((index, forward_logprobs(model.policy, *inputs, **head), mb.trained_mask))
            with autocast():
                chunk_values = model.values(mb.input_ids, mb.attention_mask, mb.response_ids.shape[1])
            if chunk_values is not None:
                values.append((index, chunk_values, mb.trained_mask))
    return tuple(batching.restore_tokens(pieces, episodes.trained_mask) if pieces else None
                 for pieces in (ref_logprobs, values, logprobs, teacher_logprobs))


def reference_logprobs(policy: nn.Module, ref_model: Optional[nn.Module], input_ids, attention_mask, response_ids, trained_mask, *,
                       temperature: float, chunk_size: Optional[int] = None, autocast: Autocast = contextlib.nullcontext,
                       padding_free: Layout = False) -> torch.Tensor:
    """(B, P + R), (B, R) -> (B, R) logprobs under the reference: `ref_model`, or (None) the LoRA policy's base with adapters off."""
    head = dict(temperature=temperature, chunk_size=chunk_size, autocast=autocast, padding_free=padding_free)
    if ref_model is not None:
        return forward_logprobs(ref_model, input_ids, attention_mask, response_ids, trained_mask, **head)
    with adapters.adapters_disabled(policy):
        return forward_logprobs(policy, input_ids, attention_mask, response_ids, trained_mask, **head)


def forward_logprobs(model: nn.Module, input_ids, attention_mask, response_ids, trained_mask, *, temperature: float,
                     chunk_size: Optional[int] = None, autocast: Autocast = contextlib.nullcontext, padding_free: Layout = False) -> torch.Tensor:
    """(B, R) logprobs of the response tokens under `model`, through `models.response_logprobs` as the training forward."""
    with autocast():
        return response_logprobs(model, input_ids, attention_mask, response_ids, trained_mask, temperature, chunk_size=chunk_size,
                                 padding_free=padding_free)[0]


def rewards(episodes: Episodes, *, kl_estimator: str, kl_clamp: Optional[float], kl_coef: float, whiten: bool,
            turn_weight: Optional[float] = None, teacher_coef: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (rewards (B, R), kl (B, R), non-score reward (B, R)): the per-token KL between the episodes' logprobs and
    ref_logprobs (`algo.kl_per_token` by `kl_estimator`, `kl_clamp`) times -kl_coef (0: the KL is not in the reward),
    plus the episodes' scores at their score_index (`algo.shape_rewards`); with a teacher's logprobs
    (`teacher_logprobs`, on-policy distillation) -teacher_coef x the reverse KL to it on every trained token
    (`algo.distillation_rewards`); with `turn_weight` (rollout.turn_rewards:
    the environment's weight in reward.weights) the environment's part of each score moved to the turns that earned
    it (`algo.place_turn_rewards`); with `whiten` the rewards whitened over the trained tokens (ppo.whiten_rewards;
    not re-centred)."""
    mask = episodes.trained_mask
    kl = algo.kl_per_token(episodes.logprobs, episodes.ref_logprobs, kl_estimator, kl_clamp) * mask
    shaped, non_score = algo.shape_rewards(episodes.scores, kl, mask, kl_coef, episodes.score_index)
    if episodes.teacher_logprobs is not None:
        shaped = shaped + algo.distillation_rewards(episodes.logprobs, episodes.teacher_logprobs, mask, teacher_coef)[0]
    if turn_weight is not None and episodes.turn_rewards is not None:
        shaped = algo.place_turn_rewards(shaped, episodes.score_index, episodes.environment_rewards, episodes.turn_rewards, turn_weight)
    if whiten:
        shaped = algo.masked_whiten(shaped, mask, shift_mean=False)
    return shaped, kl, non_score


def with_scores(episodes: Episodes, scored: Scored, pad_token_id: int, all_reduce: Reduce, uneven_forwards: bool = True) -> Episodes:
    """The episodes with stage 2's scores and valid (a failed row leaves the update), an agent's earlier segments then
    appended as rows of their own (`episodes.with_segment_rows`: the scores on the episodes' rows only), so that
    processes may hold different numbers of rows and run different numbers of no-gradient forwards over them. Where
    they may not (`uneven_forwards` False: the parallel strategy's forwards are collectives, fsdp) and several processes
    run, such rows stop the run with a UserError on every process (all_reduce: the sum over processes)."""
    episodes.scores, episodes.valid = scored.scores, scored.valid
    if episodes.earlier_segments is None:
        return episodes
    rows = with_segment_rows(episodes, pad_token_id)
    counts = all_reduce(torch.tensor([float(len(rows) - len(episodes)), 1.0], device=scored.scores.device)).tolist()
    if counts[0] and counts[1] > 1 and not uneven_forwards:
        raise UserError(f"agent: {int(counts[0])} earlier segments of this update's episodes (calls that did not continue the last one) "
                        f"would train as rows of their own, which {int(counts[1])} processes under parallel.strategy fsdp do not do "
                        "yet; use parallel.strategy ddp or one process, or keep the agent's history (one segment per episode)")
    return rows


def advantages(estimator: Estimator, episodes: Episodes, *, gamma: float, lam: float, whiten: bool, group_size: int,
               grpo_scale_std: bool, all_reduce: Reduce) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """-> (advantages (B, R), returns (B, R), None without a critic): `estimator`'s function (ppokit.training.estimators) over the episodes' rewards,
    values and baseline scores on the trained tokens; group_size: the n samples of each prompt (adjacent rows);
    all_reduce: the sum over processes (whitening statistics of the whole batch).

    Rows of several segments per episode (`Episodes.episode_index`): the estimator runs on the episode layout, each
    episode's trained tokens in call order (`segments.episode_layout`: its earlier segments' rows, then its own row),
    and its advantages and returns go back to the rows: an episode's groups, baseline and return are the episode's."""
    if episodes.episode_index is None:
        return estimator.advantages(
            episodes.rewards, episodes.trained_mask, values=episodes.values, gamma=gamma, lam=lam, whiten=whiten,
            group_size=group_size, grpo_scale_std=grpo_scale_std, baseline_scores=episodes.baseline_scores, all_reduce=all_reduce,
        )
    mask, owner = episodes.trained_mask, episodes.episode_index
    count = int(episodes.is_episode.sum())
    rows = torch.arange(len(owner), device=owner.device)
    layout = segments.episode_layout(mask, owner, torch.where(rows < count, len(owner), rows), count)
    values = None if episodes.values is None else segments.gather(episodes.values, *layout)
    baseline = None if episodes.baseline_scores is None else episodes.baseline_scores[:count]
    per_episode, returns = estimator.advantages(
        segments.gather(episodes.rewards, *layout), layout[2], values=values, gamma=gamma, lam=lam, whiten=whiten,
        group_size=group_size, grpo_scale_std=grpo_scale_std, baseline_scores=baseline, all_reduce=all_reduce,
    )
    back = [None if x is None else segments.scatter(x, *layout, tuple(mask.shape)) for x in (per_episode, returns)]
    return back[0], back[1]


def trained_on(episodes: Episodes, *, mask_truncated_completions: bool) -> Episodes:
    """The episodes that stage 6 optimises over: these, or with `mask_truncated_completions` (ppo.mask_truncated_completions)
    a copy whose loss_mask leaves out every episode that did not end by itself (`algo.mask_truncated`). Called after
    the advantages: a truncated episode's score still counted in its group's baseline and the statistics, as in TRL;
    the episodes themselves (and the metrics read from them) keep every sampled token."""
    if not mask_truncated_completions:
        return episodes
    return dataclasses.replace(episodes, loss_mask=algo.mask_truncated(episodes.loss_mask, episodes.ended))
