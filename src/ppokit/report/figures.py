"""What the report draws: figures of a few panels of curves over updates, one line per run, and the
reward-vs-KL frontier, as SVG (ppokit.report.svg draws them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from ppokit.report import svg
from ppokit.report.alarms import Alarm
from ppokit.report.rundata import RunData, eval_scores, stop_rate

Series = Callable[[RunData], tuple[list[int], list[float]]]

# Metrics on the combined score's scale: for a run with reward.normalize they are z-scores, labelled as such
# wherever they are drawn, so that they are not read against raw scores on the same axes.
SCORE_KEYS = ("objective/scores", "eval/scores", "objective/rlhf_reward")
NORMALISED = "normalised (reward.normalize)"


@dataclass
class Line:
    """One curve of a panel: a metric key, or a function computing a series from the run."""

    label: str
    key: Optional[str] = None
    compute: Optional[Series] = None
    dashed: bool = False
    markers: bool = False

    def series(self, run: RunData) -> tuple[list[int], list[float]]:
        return self.compute(run) if self.compute else run.series(self.key)


@dataclass
class Panel:
    title: str
    lines: list[Line]
    absent: str = ""  # why a run may lack it, said when it is skipped
    only_if_varies: bool = False  # a constant (e.g. a fixed kl_coef) says nothing as a curve


@dataclass
class FigureSpec:
    name: str
    title: str
    panels: list[Panel]


PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")  # matplotlib's tab10
VIRIDIS = ("#440154", "#3b528b", "#21918c", "#5ec962", "#fde725")  # matplotlib's viridis at 0, 1/4, ..., 1


def _metric(key: str, label: str = "", dashed: bool = False, markers: bool = False) -> Line:
    return Line(label or key, key=key, dashed=dashed, markers=markers)


def reward_source_panels(runs: list[RunData]) -> list[Panel]:
    """One panel per reward source (`reward/<name>`) found in any run."""
    names = sorted({k for r in runs for rec in r.records for k in rec if k.startswith("reward/") and k != "reward/skipped"})
    return [Panel(f"{name} (raw score of the source)", [_metric(name)]) for name in names]


def eval_sample_panels(runs: list[RunData]) -> list[Panel]:
    """With n samples per eval prompt (ppo.eval_pass_at_k): one panel of `eval/pass@k` for every k any run logged, and
    `eval/mean@n`, each at the updates that sampled the eval prompts."""
    keys = {k for r in runs for rec in r.records for k in rec if k.startswith(("eval/pass@", "eval/mean@"))}
    passes = sorted((k for k in keys if k.startswith("eval/pass@")), key=lambda k: int(k.rpartition("@")[2]))
    means = sorted((k for k in keys if k.startswith("eval/mean@")), key=lambda k: int(k.rpartition("@")[2]))
    panels = [Panel("eval: pass@k, unbiased over n samples per prompt (eval/pass@k)",
                    [_metric(k, k.partition("/")[2], markers=True) for k in passes])] if passes else []
    if means:
        panels.append(Panel("eval: mean score over the n samples of each prompt (eval/mean@n)", [_metric(k, markers=True) for k in means]))
    return panels


def episode_figures(runs: list[RunData]) -> list[FigureSpec]:
    """The multi-turn figure, when a run has episodes over an environment (`rollout/turns`): how often the
    environment ended them (a game won), in how many turns, with how many tokens, and how many the budget cut."""
    if not any(run.has("rollout/turns") for run in runs):
        return []
    return [FigureSpec("episodes", "Multi-turn episodes", [
        Panel("episodes the environment ended (env/done_rate)", [_metric("env/done_rate")]),
        Panel("model turns per episode (rollout/turns)", [_metric("rollout/turns")]),
        Panel("tokens per episode: the model's and the environment's",
              [_metric("rollout/model_tokens", "model (rollout/model_tokens)"),
               _metric("rollout/observation_tokens", "environment (rollout/observation_tokens)", dashed=True)]),
        Panel("episodes cut by the token budget (rollout/truncated)", [_metric("rollout/truncated")]),
    ])]


def figure_specs(runs: list[RunData]) -> list[FigureSpec]:
    return [
        FigureSpec("score", "Score", [
            Panel("score: train (objective/scores) and eval (eval/scores)",
                  [_metric("objective/scores", "train"),
                   Line("eval", key="eval/scores", compute=eval_scores, dashed=True, markers=True)]),
            Panel("score - beta x KL (objective/rlhf_reward)", [_metric("objective/rlhf_reward")]),
            *eval_sample_panels(runs),
            *reward_source_panels(runs),
        ]),
        *episode_figures(runs),
        FigureSpec("kl", "KL and how far each update moves", [
            Panel("KL to the reference (objective/kl, nats per sequence)", [_metric("objective/kl")]),
            Panel("approx KL within an update (policy/approxkl_avg)", [_metric("policy/approxkl_avg")]),
            Panel("KL coefficient beta (objective/kl_coef)", [_metric("objective/kl_coef")], only_if_varies=True),
            *([Panel("reverse KL to the teacher per token (teacher/kl)", [_metric("teacher/kl")])]
              if any(run.has("teacher/kl") for run in runs) else []),
        ]),
        FigureSpec("policy", "Entropy, clipping and the policy ratio", [
            Panel("entropy per sequence (objective/entropy)", [_metric("objective/entropy")]),
            Panel("entropy per token (policy/entropy_avg)", [_metric("policy/entropy_avg")]),
            Panel("clip fractions", [_metric("policy/clipfrac_avg", "policy"), _metric("val/clipfrac_avg", "value", dashed=True)]),
            Panel("policy ratio (val/ratio)", [_metric("val/ratio")]),
        ]),
        FigureSpec("length", "Response length and stopping", [
            Panel("mean response length, tokens (objective/response_length)", [_metric("objective/response_length")]),
            Panel("stop-token rate (val/num_eos_tokens / responses)", [Line("stop rate", compute=stop_rate)]),
        ]),
        FigureSpec("value", "Losses and the critic", [
            Panel("policy loss (loss/policy_avg)", [_metric("loss/policy_avg")]),
            Panel("value loss (loss/value_avg)", [_metric("loss/value_avg")], absent="a critic-free estimator has no value model"),
            Panel("explained variance of the value model (val/explained_variance)", [_metric("val/explained_variance")],
                  absent="logged only by runs with a critic, by ppokit versions that have it"),
        ]),
        FigureSpec("run", "Learning rate and throughput", [
            Panel("learning rate (lr)", [_metric("lr")]),
            Panel("episodes per second (eps)", [_metric("eps")]),
        ]),
    ]


def _colors(runs: list[RunData]) -> dict[str, str]:
    return {r.label: PALETTE[i % len(PALETTE)] for i, r in enumerate(runs)}


def draw_curves(spec: FigureSpec, runs: list[RunData], alarms: list[Alarm], skipped: list[str]) -> Optional[str]:
    """The SVG of `spec` (None when no panel can be drawn); the panels left out go to `skipped`, in words."""
    colors = _colors(runs)
    plots = []
    for panel in spec.panels:
        data = [(run, line, *line.series(run)) for run in runs for line in panel.lines]
        data = [d for d in data if d[2]]
        if not data:
            why = f" ({panel.absent})" if panel.absent else ""
            skipped.append(f"{panel.title}: not in the metrics{why}")
            continue
        if panel.only_if_varies and len({v for d in data for v in d[3]}) == 1:
            skipped.append(f"{panel.title}: constant at {data[0][3][0]:g}, not drawn")
            continue
        series = []
        for run, line, updates, values in data:
            label = run.label if len(runs) > 1 else ""
            if len(panel.lines) > 1:
                label = f"{label} {line.label}".strip()
            if line.key in SCORE_KEYS and run.normalised_scores:
                label = f"{label} {NORMALISED}".strip()
            series.append(svg.Series(label, updates, values, colors[run.label], dashed=line.dashed, markers=line.markers))
        drawn_runs = {run.label for run, *_ in data}
        plot = svg.Plot(panel.title, series, bands=[(a.update, colors[a.run]) for a in alarms if a.run in drawn_runs])
        if _drawable(plot, panel.title, skipped):
            plots.append(plot)
    return svg.figure(spec.title, plots) if plots else None


def draw_frontier(runs: list[RunData], skipped: list[str]) -> Optional[str]:
    """Score against KL, one point per update: the reward-vs-KL frontier of RLHF papers, as SVG (None,
    said in `skipped`, when no update has both)."""
    data = []
    for run in runs:
        kl = dict(zip(*run.series("objective/kl")))
        score_updates, scores = run.series("objective/scores")
        points = [(u, kl[u], s) for u, s in zip(score_updates, scores) if u in kl and math.isfinite(kl[u]) and math.isfinite(s)]
        evals = [(u, kl[u], e) for u, e in zip(*run.series("eval/scores")) if u in kl and math.isfinite(kl[u]) and math.isfinite(e)]
        if points:
            data.append((run, points, evals))
    if not data:
        skipped.append("reward-vs-KL frontier: no update has both objective/scores and objective/kl")
        return None
    colors = _colors(runs)
    series, colorbar = [], None
    for run, points, evals in data:
        updates, xs, ys = ([p[i] for p in points] for i in range(3))
        normalised = f" {NORMALISED}" if run.normalised_scores else ""
        if len(data) == 1:
            low, high = updates[0], updates[-1]
            shade = lambda u: svg.interpolate(VIRIDIS, (u - low) / (high - low) if high > low else 0.5)  # noqa: E731
            colorbar = svg.ColorBar("update", low, high, lambda t: svg.interpolate(VIRIDIS, t))
            series.append(svg.Series(f"train score{normalised}, one point per update", xs, ys, VIRIDIS[2], line=False, markers=True,
                                     marker_radius=3.2, marker_colors=[shade(u) for u in updates]))
            series.append(svg.Series("path (mean of 5 updates)", _rolling_mean(xs), _rolling_mean(ys), "#595959", width=1.2))
            eval_color, eval_label = PALETTE[3], f"eval score{normalised}"
        else:
            color = colors[run.label]
            series.append(svg.Series("", xs, ys, color, line=False, markers=True, marker_radius=2.2, opacity=0.45))
            series.append(svg.Series(f"{run.label}{normalised} (mean of 5 updates)", _rolling_mean(xs), _rolling_mean(ys), color,
                                     width=1.8, note=f"update {updates[-1]}"))
            eval_color, eval_label = color, f"{run.label} eval score{normalised}"
        if evals:
            series.append(svg.Series(eval_label, [e[1] for e in evals], [e[2] for e in evals], eval_color, line=False,
                                     markers=True, hollow=True, marker_radius=5))
    plot = svg.Plot("Reward vs KL: score gained for the distance travelled from the reference", series,
                    xlabel="KL to the reference (objective/kl, nats per sequence)", ylabel="score (objective/scores)",
                    integer_x=False, colorbar=colorbar)
    if not _drawable(plot, "reward-vs-KL frontier", skipped):
        return None
    return svg.figure("Reward vs KL frontier", [plot], columns=1, cell=(820, 500))


def _drawable(plot: svg.Plot, name: str, skipped: list[str]) -> bool:
    """Whether an axis can span the plot's values; if not, it is said in `skipped` under `name`."""
    try:
        plot.limits()
    except svg.Unplottable as e:
        skipped.append(f"{name}: not drawn, {e}")
        return False
    return True


def _rolling_mean(values: list[float], k: int = 5) -> list[float]:
    return [sum(values[max(0, i - k + 1): i + 1]) / len(values[max(0, i - k + 1): i + 1]) for i in range(len(values))]
