"""The report's charts, drawn with matplotlib (Figure objects and the Agg canvas: no pyplot state,
no display needed). Each figure is a few panels of curves over updates, one line per run."""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy
from matplotlib.figure import Figure

from ppokit.report.alarms import Alarm
from ppokit.report.rundata import RunData, stop_rate

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
    style: dict = field(default_factory=dict)

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


EVAL_STYLE = {"linestyle": "--", "marker": "o", "markersize": 4}


def _metric(key: str, label: str = "", **style) -> Line:
    return Line(label or key, key=key, style=style)


def reward_source_panels(runs: list[RunData]) -> list[Panel]:
    """One panel per reward source (`reward/<name>`) found in any run."""
    names = sorted({k for r in runs for rec in r.records for k in rec if k.startswith("reward/") and k != "reward/skipped"})
    return [Panel(f"{name} (raw score of the source)", [_metric(name)]) for name in names]


def figure_specs(runs: list[RunData]) -> list[FigureSpec]:
    return [
        FigureSpec("score", "Score", [
            Panel("score: train (objective/scores) and eval (eval/scores)",
                  [_metric("objective/scores", "train"), _metric("eval/scores", "eval", **EVAL_STYLE)]),
            Panel("score - beta x KL (objective/rlhf_reward)", [_metric("objective/rlhf_reward")]),
            *reward_source_panels(runs),
        ]),
        FigureSpec("kl", "KL and how far each update moves", [
            Panel("KL to the reference (objective/kl, nats per sequence)", [_metric("objective/kl")]),
            Panel("approx KL within an update (policy/approxkl_avg)", [_metric("policy/approxkl_avg")]),
            Panel("KL coefficient beta (objective/kl_coef)", [_metric("objective/kl_coef")], only_if_varies=True),
        ]),
        FigureSpec("policy", "Entropy, clipping and the policy ratio", [
            Panel("entropy per sequence (objective/entropy)", [_metric("objective/entropy")]),
            Panel("entropy per token (policy/entropy_avg)", [_metric("policy/entropy_avg")]),
            Panel("clip fractions", [_metric("policy/clipfrac_avg", "policy"), _metric("val/clipfrac_avg", "value", linestyle="--")]),
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
    palette = [f"C{i}" for i in range(10)]
    return {r.label: palette[i % len(palette)] for i, r in enumerate(runs)}


def draw_curves(spec: FigureSpec, runs: list[RunData], alarms: list[Alarm], skipped: list[str]) -> Optional[Figure]:
    """The figure of `spec` (None when no run has any of its metrics); the panels left out go to `skipped`, in words."""
    colors = _colors(runs)
    drawn = []
    for panel in spec.panels:
        data = [(run, line, *line.series(run)) for run in runs for line in panel.lines]
        data = [d for d in data if d[2]]
        if data and panel.only_if_varies and len({v for d in data for v in d[3]}) == 1:
            skipped.append(f"{panel.title}: constant at {data[0][3][0]:g}, not drawn")
        elif data:
            drawn.append((panel, data))
        else:
            why = f" ({panel.absent})" if panel.absent else ""
            skipped.append(f"{panel.title}: not in the metrics{why}")
    if not drawn:
        return None
    columns = 2 if len(drawn) > 1 else 1
    rows = math.ceil(len(drawn) / columns)
    fig = Figure(figsize=(6.4 * columns, 3.2 * rows))
    axes = fig.subplots(rows, columns, squeeze=False, gridspec_kw=_fixed_margins(fig, rows, columns)).ravel()
    for ax, (panel, data) in zip(axes, drawn):
        for run, line, updates, values in data:
            label = run.label if len(runs) > 1 else ""
            if len(panel.lines) > 1:
                label = f"{label} {line.label}".strip()
            if line.key in SCORE_KEYS and run.normalised_scores:
                label = f"{label} {NORMALISED}".strip()
            ax.plot(updates, values, color=colors[run.label], label=label or None, linewidth=1.4, **line.style)
        for alarm in alarms:
            if alarm.run in {run.label for run, *_ in data}:
                ax.axvline(alarm.update, color=colors[alarm.run], alpha=0.25, linewidth=3)
        ax.set_title(panel.title, fontsize=9.5)
        ax.set_xlabel("update", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if any(line_label for line_label in ax.get_legend_handles_labels()[1]):
            ax.legend(fontsize=7.5, loc="best")  # named: matplotlib warns on its default "best" when placing it takes over 1 s (a busy machine)
    for ax in axes[len(drawn):]:
        ax.set_visible(False)
    return fig


def draw_frontier(runs: list[RunData], skipped: list[str]) -> Optional[Figure]:
    """Score against KL, one point per update: the reward-vs-KL frontier of RLHF papers (None, said in
    `skipped`, when no update has both)."""
    data = []
    for run in runs:
        kl = dict(zip(*run.series("objective/kl")))
        score_updates, scores = run.series("objective/scores")
        points = [(u, kl[u], s) for u, s in zip(score_updates, scores) if u in kl and math.isfinite(kl[u]) and math.isfinite(s)]
        evals = [(u, kl[u], e) for u, e in zip(*run.series("eval/scores")) if u in kl and math.isfinite(e)]
        if points:
            data.append((run, points, evals))
    if not data:
        skipped.append("reward-vs-KL frontier: no update has both objective/scores and objective/kl")
        return None
    fig = Figure(figsize=(7.5, 5))
    ax = fig.subplots(gridspec_kw=_fixed_margins(fig, left=0.75, bottom=0.55, right=0.55))  # room for "update N" past the last point
    colors = _colors(runs)
    for run, points, evals in data:
        updates = [p[0] for p in points]
        xs, ys = [p[1] for p in points], [p[2] for p in points]
        normalised = f" {NORMALISED}" if run.normalised_scores else ""
        if len(data) == 1:
            dots = ax.scatter(xs, ys, c=updates, cmap="viridis", s=22, zorder=3, label=f"train score{normalised}, one point per update")
            fig.colorbar(dots, ax=ax, label="update")
            ax.plot(_rolling_mean(xs), _rolling_mean(ys), color="0.35", linewidth=1.2, zorder=2, label="path (mean of 5 updates)")
        else:
            ax.scatter(xs, ys, color=colors[run.label], s=8, alpha=0.45)
            ax.plot(_rolling_mean(xs), _rolling_mean(ys), color=colors[run.label], linewidth=1.6,
                    label=f"{run.label}{normalised} (mean of 5 updates)")
            ax.annotate(f"update {updates[-1]}", (xs[-1], ys[-1]), fontsize=7, color=colors[run.label])
        if evals:
            ax.scatter([e[1] for e in evals], [e[2] for e in evals], facecolors="none", edgecolors=colors[run.label] if len(data) > 1 else "C3",
                       s=60, linewidths=1.4, zorder=4, label=f"{run.label + ' ' if len(data) > 1 else ''}eval score{normalised}")
    ax.set_xlabel("KL to the reference (objective/kl, nats per sequence)")
    ax.set_ylabel("score (objective/scores)")
    ax.set_title("Reward vs KL: score gained for the distance travelled from the reference", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return fig


def _fixed_margins(fig: Figure, rows: int = 1, columns: int = 1, left: float = 0.7, right: float = 0.2, top: float = 0.35,
                   bottom: float = 0.45, between: float = 0.55) -> dict:
    """Subplot parameters placing the axes with fixed margins, in inches: room for 8-pt tick labels of up to
    9 characters on the left, a 9.5-pt title above, the x label below and `between` the panels. Fixed rather
    than matplotlib's constrained layout, which measured every text's extent on each draw: a third of the
    report's time."""
    width, height = fig.get_size_inches()
    axes_width = (width - left - right - (columns - 1) * between) / columns
    axes_height = (height - top - bottom - (rows - 1) * (between + top)) / rows
    return dict(left=left / width, right=1 - right / width, top=1 - top / height, bottom=bottom / height,
                wspace=between / axes_width, hspace=(between + top) / axes_height)


def _rolling_mean(values: list[float], k: int = 5) -> list[float]:
    return [sum(values[max(0, i - k + 1): i + 1]) / len(values[max(0, i - k + 1): i + 1]) for i in range(len(values))]


def png_of(draw: Callable[[], Optional[Figure]], title: str, skipped: list[str]) -> Optional[bytes]:
    """The figure `draw` makes, as PNG; None when it makes none, or (said in `skipped`) when matplotlib
    cannot draw it: finite values near the float limit (a damaged metrics.jsonl) leave an axis no
    scale to compute, and matplotlib fails on them in plot, axvline or savefig."""
    buffer = io.BytesIO()
    try:
        with warnings.catch_warnings(), numpy.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            fig = draw()
            if fig is None:
                return None
            fig.savefig(buffer, format="png", dpi=110)
    except (ValueError, OverflowError) as e:  # numpy's LinAlgError is a ValueError
        skipped.append(f"{title}: not drawn, its values are out of the range matplotlib can draw ({e})")
        return None
    return buffer.getvalue()
