"""Over-optimisation alarms: read a run's metrics and samples, say where it went wrong and why.

Each alarm is one function of a `RunData` and the thresholds; it returns the first update where
its condition held (for `consecutive` updates in a row where the alarm says so) with the
evidence in numbers, or None. Thresholds are `AlarmThresholds`, documented field by field and
loadable from YAML (`ppokit report --thresholds FILE` / `--threshold key=value`).
The alarms are explained, with their defaults, in docs/report.md.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Optional

# Only ppokit.config.schema (tests/test_report.py): the report reads run folders and nothing that trains.
from ppokit.config.schema import doc, load_config, non_negative, positive, unit_interval
from ppokit.errors import UserError
from ppokit.report.rundata import RunData, score_spread, stop_rate

at_least_one = positive


@dataclass
class AlarmThresholds:
    """When each alarm fires. Scores are in the run's own units; KL in nats per sequence."""

    baseline_updates: int = doc(3, "Updates at the start whose mean is the reference level of response length, entropy, stop rate and score (one batch is "
                                   "noisy).", check=at_least_one)
    consecutive: int = doc(2, "A level alarm (length, stop rate, entropy, ratio, clip fraction) fires when its condition holds this many updates in a row, and "
                              "names the first of them.", check=at_least_one)
    kl_window: int = doc(3, "KL growth: the recent slope is measured over this many updates.", check=at_least_one)
    kl_growth_ratio: float = doc(3.0, "KL growth: fires when the KL slope over the last `kl_window` updates exceeds this many times its mean slope over the "
                                      "run before that window ...", check=positive)
    kl_consecutive: int = doc(3, "... for this many updates in a row (a one-off step up that then levels off is not a runaway).", check=at_least_one)
    kl_min_slope: float = doc(0.05, "KL growth: slopes (nats per update) below this count as this, so a flat start near 0 does not make every later rise look "
                                    "like an explosion.", check=positive)
    length_drift: float = doc(0.5, "Response length: fires when the mean response length moves more than this fraction away from its start ...", check=positive)
    length_min_change: float = doc(2.0, "... and by at least this many tokens.", check=non_negative)
    length_pinned: float = doc(0.95, "Pinned "
                                     "length: fires when the mean response length is at least this fraction of `ppo.response_length` ...", check=unit_interval)
    stop_rate_floor: float = doc(0.5, "... while "
                                      "the share of responses that produced the stop token falls below this (having started above it).", check=unit_interval)
    entropy_collapse: float = doc(0.25, "Entropy collapse: fires when the per-token policy entropy (`policy/entropy_avg`) falls below this fraction of its "
                                        "start.", check=unit_interval)
    repeat_ngram: int = doc(3, "Repetition: n of the word n-grams counted in sample completions.", check=at_least_one)
    repeat_rate: float = doc(0.25, "Repetition: fires at a sample generation where this share (or more) of the completions' n-grams repeat an earlier n-gram "
                                   "of the same completion ...", check=unit_interval)
    repeat_rise: float = doc(0.15, "... and that share rose by at least this much since the first generation.", check=unit_interval)
    eval_drop_fraction: float = doc(0.25, "Train up, eval down: fires when the eval score falls below its best so far by this fraction of the train score's "
                                          "range over the run (or `eval_min_drop`, whichever is larger) while the train score is at or above where it was at "
                                          "the eval's best.", check=positive)
    eval_min_drop: float = doc(0.02, "Train up, eval down: the smallest eval drop (score units) that counts.", check=non_negative)
    ratio_max_deviation: float = doc(0.2, "Policy ratio: fires when `val/ratio` is further than this from 1.", check=positive)
    clipfrac_max: float = doc(0.3, "Clip fraction: fires when `policy/clipfrac_avg` exceeds this.", check=unit_interval)
    weak_reward_window: float = doc(0.5, "Weak reward: judged over the updates after the baseline up to this fraction of the run so far (later, a converged "
                                         "policy's samples all score alike) ...", check=unit_interval)
    weak_reward_ratio: float = doc(4.0, "... fires when the median spread (std) of the scores within a batch is below this many times the median kl_coef x KL "
                                        "there ...", check=positive)
    weak_reward_min_gain: float = doc(1.0, "... and the score rose by less than this many times its spread at the start.", check=non_negative)

    @classmethod
    def from_mapping(cls, data: dict, source: str = "thresholds") -> "AlarmThresholds":
        """Build from a YAML mapping; an unknown key or a value out of range is an error naming it."""
        if not isinstance(data, dict):
            raise UserError(f"{source}: expected a mapping of threshold names to values")
        return load_config(cls, data=data)


@dataclass
class Alarm:
    """One alarm of one run: `update` is where it fired; `evidence` the numbers; `advice` what to try."""

    kind: str
    title: str
    update: int
    evidence: str
    advice: str
    run: str = ""


# --------------------------------------------------------------------------- helpers


def _smoothed(values: list[float], k: int = 3) -> list[float]:
    """Trailing median of k values: one noisy batch does not fire a level alarm."""
    return [statistics.median(values[max(0, i - k + 1): i + 1]) for i in range(len(values))]


def _first_run(flags: list[bool], length: int) -> Optional[int]:
    """Index of the first of `length` consecutive True flags, or None."""
    streak = 0
    for i, flag in enumerate(flags):
        streak = streak + 1 if flag else 0
        if streak == length:
            return i - length + 1
    return None


def _sustained(values: list[float], condition: Callable[[float], bool], length: int, skip: int = 0) -> Optional[int]:
    """Index of the first of `length` consecutive values (from index `skip` on) that meet `condition`."""
    return _first_run([i >= skip and condition(v) for i, v in enumerate(values)], length)


def _finite(updates: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    pairs = [(u, v) for u, v in zip(updates, values) if math.isfinite(v)]
    return [u for u, _ in pairs], [v for _, v in pairs]


def _mean(values: list[float]) -> float:
    """Overflows to inf where statistics.fmean raises (finite metrics near 1.8e308 are damaged, not a crash)."""
    return sum(values) / len(values)


def _baseline(values: list[float], t: AlarmThresholds) -> float:
    return _mean(values[: t.baseline_updates])


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def repetition(completion: str, n: int) -> tuple[int, int]:
    """(repeated n-grams, n-grams) of a completion's words: an n-gram counts as repeated when the
    same completion already had it."""
    words = completion.split()
    grams = [tuple(words[i: i + n]) for i in range(len(words) - n + 1)]
    return len(grams) - len(set(grams)), len(grams)


# --------------------------------------------------------------------------- the alarms


def kl_superlinear(run: RunData, t: AlarmThresholds) -> Optional[Alarm]:
    updates, kl = _finite(*run.series("objective/kl"))
    w = t.kl_window
    flags, recent, before = [], [], []
    for i in range(len(kl)):
        if i - w < 2:  # at least two updates before the window give its earlier slope
            flags.append(False)
            recent.append(math.nan)
            before.append(math.nan)
            continue
        slope_recent = (kl[i] - kl[i - w]) / (updates[i] - updates[i - w])
        slope_before = max(t.kl_min_slope, (kl[i - w] - kl[0]) / (updates[i - w] - updates[0]))
        recent.append(slope_recent)
        before.append(slope_before)
        flags.append(slope_recent > t.kl_growth_ratio * slope_before and slope_recent > t.kl_min_slope)
    first = _first_run(flags, t.kl_consecutive)
    if first is None:
        return None
    i = first
    # Name where the acceleration began: the first step inside the window steeper than the alarm's ratio.
    onset = next(j for j in range(i - w + 1, i + 1) if kl[j] - kl[j - 1] > t.kl_growth_ratio * before[i] * (updates[j] - updates[j - 1]) or j == i)
    u = updates[onset]
    later = ", ".join(f"{_fmt(v)} at update {x}" for x, v in list(zip(updates, kl))[onset: onset + 4])
    return Alarm(
        "kl_superlinear", "KL growing faster than linear", u,
        f"objective/kl rose {_fmt(recent[i])} per update over updates {updates[i - w]}-{updates[i]}, {recent[i] / before[i]:.1f}x "
        f"its mean slope of {_fmt(before[i])} per update before, and kept accelerating for {t.kl_consecutive} updates "
        f"(to update {updates[i + t.kl_consecutive - 1]}); the steep rise starts at update {u}: {later}",
        "the policy is moving away from the reference faster and faster, the usual sign that it found a way to raise "
        "the score that the reference would not write (reward hacking): look at the samples from this update on; "
        "raise ppo.kl_coef, set ppo.kl_target (adaptive KL) or lower ppo.learning_rate",
    )


def length_drift(run: RunData, t: AlarmThresholds) -> Optional[Alarm]:
    updates, length = _finite(*run.series("objective/response_length"))
    if len(length) <= t.baseline_updates:
        return None
    start = _baseline(length, t)
    far = max(t.length_drift * start, t.length_min_change)
    first = _sustained(length, lambda v: abs(v - start) > far, t.consecutive, skip=t.baseline_updates)
    if first is None:
        return None
    v = length[first]
    way = "grew" if v > start else "shrank"
    return Alarm(
        "length_drift", "Response length drifting from its start", updates[first],
        f"mean response length {way} from {_fmt(start)} tokens (mean of the first {t.baseline_updates} updates) to "
        f"{_fmt(v)} at update {updates[first]}, {abs(v - start) / start:.0%} away, and stayed that far for {t.consecutive} updates; "
        f"last {_fmt(length[-1])}",
        "a reward that grows (or shrinks) with length is being exploited rather than the task learned: compare samples "
        "before and after; a reward.length_penalty, ppo.missing_eos_penalty or a length-normalised reward helps",
    )


def length_pinned(run: RunData, t: AlarmThresholds) -> Optional[Alarm]:
    limit = run.setting("ppo.response_length")
    l_updates, length = _finite(*run.series("objective/response_length"))
    s_updates, rate = stop_rate(run)
    if not isinstance(limit, int) or not rate or len(rate) <= t.baseline_updates:
        return None
    start_rate = _baseline(rate, t)
    if start_rate < t.stop_rate_floor:
        return None  # it never stopped well: nothing collapsed (the SFT model may not end with the stop token)
    length_at = dict(zip(l_updates, length))
    flags = [
        i >= t.baseline_updates and r < t.stop_rate_floor and length_at.get(u, 0) >= t.length_pinned * limit
        for i, (u, r) in enumerate(zip(s_updates, rate))
    ]
    first = _first_run(flags, t.consecutive)
    if first is None:
        return None
    u = s_updates[first]
    return Alarm(
        "length_pinned", "Responses pinned at response_length, stop rate collapsing", u,
        f"at update {u} the mean response length is {_fmt(length_at[u])} of ppo.response_length {limit} and "
        f"{rate[first]:.0%} of responses end with the stop token, down from {start_rate:.0%} "
        f"over the first {t.baseline_updates} updates",
        "the policy stopped ending its answers: the reward likely pays for more text, or text after the point an answer "
        "should stop; ppo.missing_eos_penalty (as in TRL) makes not stopping cost, or fix the reward",
    )


def entropy_collapse(run: RunData, t: AlarmThresholds) -> Optional[Alarm]:
    key = "policy/entropy_avg"
    updates, entropy = _finite(*run.series(key))
    if len(entropy) <= t.baseline_updates:
        return None
    start = _baseline(entropy, t)
    if start <= 0:
        return None
    first = _sustained(entropy, lambda v: v < t.entropy_collapse * start, t.consecutive, skip=t.baseline_updates)
    if first is None:
        return None
    return Alarm(
        "entropy_collapse", "Entropy collapse", updates[first],
        f"{key} (per-token entropy of the policy) fell from {_fmt(start)} at the start to {_fmt(entropy[first])} at update "
        f"{updates[first]} ({entropy[first] / start:.0%} of its start, below {t.entropy_collapse:.0%}); last {_fmt(entropy[-1])}",
        "the policy has become nearly deterministic: it explores no more and tends to repeat one answer; "
        "lower ppo.learning_rate, raise ppo.kl_coef, or check the samples for one repeated completion",
    )


def repeated_ngrams(run: RunData, t: AlarmThresholds) -> Optional[Alarm]:
    by_update: dict[int, list[str]] = {}
    for row in run.samples:
        by_update.setdefault(row["update"], []).append(row["completion"])
    rates = []
    for update, completions in sorted(by_update.items()):
        counts = [repetition(c, t.repeat_ngram) for c in completions]
        total = sum(n for _, n in counts)
        if total:
            rates.append((update, sum(r for r, _ in counts) / total, completions))
    if len(rates) < 2:
        return None
    first_rate = rates[0][1]
    for update, rate, completions in rates[1:]:
        if rate >= t.repeat_rate and rate - first_rate >= t.repeat_rise:
            worst = max(completions, key=lambda c: repetition(c, t.repeat_ngram)[0])
            return Alarm(
                "repeated_ngrams", "Repeated n-grams rising in completions", update,
                f"{rate:.0%} of the word {t.repeat_ngram}-grams of the sample completions at update {update} repeat one "
                f"earlier in the same completion, up from {first_rate:.0%} at update {rates[0][0]}; for example: {_clip(worst)!r}",
                "repeating a phrase the reward likes is a classic reward hack: look at the samples; raise ppo.kl_coef, or add "
                "a repetition penalty to the reward",
            )
    return None


def train_up_eval_down(run: RunData, t: AlarmThresholds) -> Optional[Alarm]:
    e_updates, evals = _finite(*run.series("eval/scores"))
    s_updates, scores = _finite(*run.series("objective/scores"))
    if len(evals) < 2 or len(scores) < 2:
        return None
    train = dict(zip(s_updates, _smoothed(scores)))
    smooth = list(train.values())
    drop = max(t.eval_min_drop, t.eval_drop_fraction * (max(smooth) - min(smooth)))
    best = 0
    for i in range(1, len(evals)):
        if evals[i] > evals[best]:
            best = i
            continue
        u, u_best = e_updates[i], e_updates[best]
        fell = evals[best] - evals[i]
        if fell >= drop and u in train and u_best in train and train[u] >= train[u_best]:
            return Alarm(
                "train_up_eval_down", "Train score rising while eval score falls", u,
                f"eval/scores fell from {_fmt(evals[best])} (update {u_best}, its best) to {_fmt(evals[i])} at update {u} "
                f"(-{_fmt(fell)}, the alarm's drop is {_fmt(drop)}) while the train score went {_fmt(train[u_best])} -> {_fmt(train[u])} "
                "(median of 3)",
                "the policy is fitting the training prompts (or the reward's blind spots on them) rather than the task: "
                "compare train and eval samples; stop at the eval's best checkpoint, raise ppo.kl_coef or add prompts",
            )
    return None


def ratio_off(run: RunData, t: AlarmThresholds) -> Optional[Alarm]:
    updates, ratio = _finite(*run.series("val/ratio"))
    first = _sustained(ratio, lambda r: abs(r - 1) > t.ratio_max_deviation, t.consecutive)
    if first is None:
        return None
    worst = max(ratio, key=lambda r: abs(r - 1))
    return Alarm(
        "ratio_off", "Policy ratio far from 1", updates[first],
        f"val/ratio (mean new/old probability in the PPO epochs) is {_fmt(ratio[first])} at update {updates[first]}, "
        f"further than {t.ratio_max_deviation} from 1 for {t.consecutive} updates in a row; furthest {_fmt(worst)}",
        "each update moves the policy much more than the clip range allows for: lower ppo.learning_rate or ppo.num_ppo_epochs; "
        "a ratio off 1 at update 1 means the rollout and training forwards differ (dropout, precision)",
    )


def clipfrac_high(run: RunData, t: AlarmThresholds) -> Optional[Alarm]:
    updates, clip = _finite(*run.series("policy/clipfrac_avg"))
    first = _sustained(clip, lambda c: c > t.clipfrac_max, t.consecutive)
    if first is None:
        return None
    return Alarm(
        "clipfrac_high", "Clip fraction high", updates[first],
        f"policy/clipfrac_avg is {clip[first]:.0%} at update {updates[first]} (above {t.clipfrac_max:.0%} for "
        f"{t.consecutive} updates in a row); highest {max(clip):.0%}",
        "most tokens' ratios are clipped, so most of each update's gradient is thrown away: lower ppo.learning_rate or "
        "ppo.num_ppo_epochs, or raise ppo.num_mini_batches",
    )


def nonfinite_skips(run: RunData, t: AlarmThresholds) -> Optional[Alarm]:
    skipped = [(r["update"], sorted(k.split("/", 1)[1] for k in r if k.startswith("nonfinite/"))) for r in run.records]
    skipped = [(u, q) for u, q in skipped if q]
    if not skipped:
        return None
    listed = "; ".join(f"update {u}: {', '.join(q)}" for u, q in skipped[:8]) + ("; ..." if len(skipped) > 8 else "")
    return Alarm(
        "nonfinite", "Updates skipped for a non-finite value", skipped[0][0],
        f"{len(skipped)} update{'s' if len(skipped) > 1 else ''} rolled back because a value was NaN or infinite ({listed})",
        "a score, loss or gradient went NaN/inf: check the reward source on those batches (docs/checkpoints.md); a loss "
        "or gradient that does so points at the learning rate or precision (fp16)",
    )


def weak_reward(run: RunData, t: AlarmThresholds) -> Optional[Alarm]:
    """Judged over the first part of the run (`weak_reward_window`): later, a policy that learned and
    converged has samples that all score alike, which is no sign of a weak reward."""
    spread_updates, spread, source = score_spread(run)
    k_updates, kl = _finite(*run.series("objective/kl"))
    s_updates, scores = _finite(*run.series("objective/scores"))
    if not spread or len(scores) < t.baseline_updates + 4:
        return None
    coef_at = dict(zip(*run.series("objective/kl_coef")))
    default_coef = run.setting("ppo.kl_coef")
    end = max(s_updates[t.baseline_updates + 3], int(s_updates[-1] * t.weak_reward_window))
    inside = lambda u: s_updates[t.baseline_updates - 1] < u <= end  # noqa: E731
    penalties = [coef_at.get(u, default_coef) * max(v, 0.0) for u, v in zip(k_updates, kl)
                 if inside(u) and isinstance(coef_at.get(u, default_coef), (int, float))]
    spreads = [sd for u, sd in zip(spread_updates, spread) if inside(u)]
    if not penalties or not spreads:
        return None
    penalty, typical_spread = statistics.median(penalties), statistics.median(spreads)
    start_spread = _mean([sd for u, sd in zip(spread_updates, spread) if u <= s_updates[t.baseline_updates - 1]] or spread[:1])
    start_score = _baseline(scores, t)
    score_at_end = dict(zip(s_updates, _smoothed(scores)))[max(u for u in s_updates if u <= end)]
    gain = score_at_end - start_score
    if not (penalty > 0 and typical_spread < t.weak_reward_ratio * penalty and gain < t.weak_reward_min_gain * start_spread):
        return None
    normalize = run.setting("reward.normalize")
    if normalize is True or (isinstance(normalize, list) and all(normalize)):
        advice = ("reward.normalize is already on: lower ppo.kl_coef (or use ppo.kl_target), or use a reward that tells "
                  "completions apart more sharply")
    else:
        advice = ("set `reward.normalize: true` (each source standardised by its running mean and std), so the reward is on "
                  "a scale the KL penalty does not drown, or lower ppo.kl_coef. Measured on the demo model with a reward "
                  "in [0, 0.2] and kl_coef 0.05: the score moved 0.12 -> 0.15 in 32 updates; the same run with "
                  "reward.normalize: true moved the raw score 0.12 -> 0.18 (docs/report.md)")
    first = s_updates[t.baseline_updates]
    return Alarm(
        "weak_reward", "Reward too weak for its KL penalty", end,
        f"over updates {first}-{end} the scores within a batch spread by {_fmt(typical_spread)} (median std, from {source}) "
        f"while the KL penalty kl_coef x KL is {_fmt(penalty)} per sequence (median), {typical_spread / penalty:.1f}x, "
        f"under {t.weak_reward_ratio:g}x; the score moved {_fmt(start_score)} -> {_fmt(score_at_end)}, "
        f"less than {t.weak_reward_min_gain:g}x its starting spread {_fmt(start_spread)}",
        "the differences the reward makes between completions are not much larger than what the KL penalty takes, so PPO "
        f"learns slowly or learns to stay near the reference; {advice}",
    )


ALARMS: tuple[Callable[[RunData, AlarmThresholds], Optional[Alarm]], ...] = (
    kl_superlinear, length_drift, length_pinned, entropy_collapse, repeated_ngrams,
    train_up_eval_down, ratio_off, clipfrac_high, nonfinite_skips, weak_reward,
)


def find_alarms(run: RunData, thresholds: Optional[AlarmThresholds] = None) -> list[Alarm]:
    """Every alarm that fires on `run`, in order of the update where it fired."""
    thresholds = thresholds or AlarmThresholds()
    alarms = [a for a in (check(run, thresholds) for check in ALARMS) if a is not None]
    for alarm in alarms:
        alarm.run = run.label
    return sorted(alarms, key=lambda a: a.update)


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
