"""The report as one HTML file: figures inline as SVG, no script, no request to anywhere, so it opens
from disk anywhere (mail it, attach it to an issue)."""

from __future__ import annotations

import dataclasses
import html
import math
from typing import Optional

from ppokit.report.alarms import Alarm, AlarmThresholds
from ppokit.report.rundata import RunData

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1320px; padding: 0 1em; color: #1d1d1f; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { margin-top: 1.8em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
h3 { font-size: 1.05em; margin-bottom: 0.4em; }
.meta { color: #666; font-size: 0.9em; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f5f5f7; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.alarm { border-left: 5px solid #d33; background: #fff5f5; padding: 0.6em 0.9em; margin: 0.6em 0; }
.alarm .what { font-weight: 600; } .alarm .advice { color: #444; margin-top: 0.3em; }
.ok { border-left: 5px solid #2a2; background: #f4fff4; padding: 0.6em 0.9em; }
.note { color: #555; }
svg.chart { display: block; max-width: 100%; height: auto; border: 1px solid #eee; }
code { background: #f5f5f7; padding: 0 0.2em; }
"""


def e(text) -> str:
    return html.escape(str(text))


def _num(value, digits: int = 3, signed: bool = True) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "" if value is None else e(value)
    if isinstance(value, int):
        return str(value)
    if math.isnan(value) or abs(value) >= 1000:
        return f"{value:.4g}"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _status(run: RunData) -> str:
    done = run.records[-1]["update"] if run.records else 0
    total = run.total_updates
    of = f" of {total}" if total else ""
    if run.finished:
        return f"finished: {done}{of} updates"
    return f"not finished (in progress, stopped or crashed): {done}{of} updates"


def _sources(run: RunData) -> str:
    reward = run.config.get("reward") if isinstance(run.config.get("reward"), dict) else {}
    functions = reward.get("functions") or []
    if not isinstance(functions, list):  # a damaged config.yaml: shown as it is
        functions = [functions]
    parts = ([f"model {reward['model']}"] if reward.get("model") else []) + [
        str(f.get("function", f)) if isinstance(f, dict) else str(f) for f in functions
    ]
    if reward.get("remote"):
        parts.append("remote")
    if run.config.get("environment"):  # its step rewards are a source of their own (reward/environment)
        parts.append(f"environment {run.config['environment']}")
    return ", ".join(parts)


def runs_table(runs: list[RunData]) -> str:
    rows = []
    for run in runs:
        last = run.records[-1] if run.records else {}
        rows.append(
            "<tr>" + "".join([
                f"<td>{e(run.label)}</td>", f"<td><code>{e(run.path)}</code></td>", f"<td>{e(_status(run))}</td>",
                f"<td>{e(run.setting('model', ''))}</td>", f"<td>{e(_sources(run))}</td>",
                f"<td class=num>{_num(run.setting('ppo.kl_coef'), signed=False)}</td>",
                f"<td class=num>{_num(last.get('objective/scores'))}{' (normalised)' if run.normalised_scores else ''}</td>",
                f"<td class=num>{_num(last.get('objective/kl'), signed=False)}</td>",
            ]) + "</tr>"
        )
    head = "".join(f"<th>{h}</th>" for h in ("run", "directory", "status", "model", "reward", "kl_coef", "last score", "last KL"))
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def alarms_section(runs: list[RunData], alarms: list[Alarm]) -> str:
    parts = []
    for run in runs:
        mine = [a for a in alarms if a.run == run.label]
        prefix = f"{e(run.label)}: " if len(runs) > 1 else ""
        if not mine:
            checked = "no metrics to check" if not run.records else f"{len(run.records)} updates checked"
            parts.append(f'<div class="ok">{prefix}no alarms ({checked}).</div>')
            continue
        for a in mine:
            parts.append(
                f'<div class="alarm" id="alarm-{e(a.kind)}"><div class="what">{prefix}update {a.update}: {e(a.title)}</div>'
                f"<div>{e(a.evidence)}</div><div class=advice>{e(a.advice)}</div></div>"
            )
    return "\n".join(parts)


def notes_section(runs: list[RunData], skipped_panels: list[str]) -> str:
    items = [f"<li>{e(run.label)}: {e(note)}</li>" for run in runs for note in run.notes]
    items += [f"<li>{e(p)}</li>" for p in skipped_panels]
    return f"<ul class=note>{''.join(items)}</ul>" if items else "<p class=note>Nothing was skipped.</p>"


def figure_html(name: str, title: str, drawing: str) -> str:
    """A figure's heading and its SVG, inline (ppokit.report.svg escapes every text in it)."""
    return f'<h2 id="fig-{e(name)}">{e(title)}</h2>\n{drawing}'


def samples_section(run: RunData, max_prompts: int) -> str:
    """Eval samples: for each of the first `max_prompts` eval prompts, its completion at every sample
    generation. Training-batch samples (no eval data) have different prompts each time: one table per generation."""
    if not run.samples:
        return "<p class=note>No samples (samples.jsonl is missing or empty).</p>"
    generations: dict[int, list[dict]] = {}
    for row in run.samples:
        generations.setdefault(row["update"], []).append(row)
    if all(row.get("split") == "eval" for row in run.samples):
        before = " (update 0: before training)" if 0 in generations else ""
        parts = [f"<p class=note>The same eval prompts at each of {len(generations)} sample generations "
                 f"(updates {', '.join(map(str, generations))}){before}; the first {max_prompts} prompts.</p>"]
        for k in range(max_prompts):
            rows = [(u, g[k]) for u, g in generations.items() if k < len(g)]
            if not rows:
                break
            body = "".join(f"<tr><td class=num>{u}</td><td class=num>{_num(r.get('score'))}</td><td>{_completion(r)}</td></tr>" for u, r in rows)
            parts.append(f"<h3>prompt: {e(rows[0][1].get('prompt', ''))}</h3><table><tr><th>update</th><th>score</th><th>completion</th></tr>{body}</table>")
        return "\n".join(parts)
    parts = ["<p class=note>These samples come from the training batch at each generation (the run had no eval data), "
             "so the prompts differ from one generation to the next.</p>"]
    for u, rows in generations.items():
        body = "".join(f"<tr><td>{e(r.get('prompt', ''))}</td><td "
                       f"class=num>{_num(r.get('score'))}</td><td>{_completion(r)}</td></tr>" for r in rows[:max_prompts])
        parts.append(f"<h3>update {u}</h3><table><tr><th>prompt</th><th>score</th><th>completion</th></tr>{body}</table>")
    return "\n".join(parts)


def _completion(row: dict) -> str:
    """A sample's completion as HTML: a multi-turn episode's turns (`turns`) one per line, each marked with its role;
    a model turn the environment rewarded or ended the episode on (a game won) says so."""
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns:
        return e(row["completion"])
    return "<br>".join(f"<b>{e(t.get('role', '?'))}:</b> {e(t.get('text', ''))}{_turn_outcome(t)}" for t in turns if isinstance(t, dict))


def _turn_outcome(turn: dict) -> str:
    """What the environment said of a turn, after its text: the budget cut it, it rewarded it, it ended the episode."""
    notes = ["cut by the token budget"] if turn.get("cut") else []
    reward = turn.get("reward")
    if isinstance(reward, (int, float)) and not isinstance(reward, bool) and reward != 0:
        notes.append(f"reward {_num(float(reward), 2)}")
    final = turn.get("final_reward")  # the environment's get_reward, on the episode's last turn
    if isinstance(final, (int, float)) and not isinstance(final, bool):
        notes.append(f"get_reward {_num(float(final), 2)}")
    if turn.get("done") is True:
        notes.append("the environment ended the episode")
    return f" <i>({'; '.join(notes)})</i>" if notes else ""


def thresholds_table(thresholds: AlarmThresholds) -> str:
    rows = "".join(f"<tr><td><code>{f.name}</code></td><td class=num>{e(getattr(thresholds, f.name))}</td><td>{e(f.metadata['help'])}</td></tr>"
                   for f in dataclasses.fields(thresholds))
    return f"<table><tr><th>threshold</th><th>value</th><th>meaning</th></tr>{rows}</table>"


def render_page(
    runs: list[RunData], alarms: list[Alarm], figures: list[tuple[str, str, str]], skipped_panels: list[str],
    thresholds: AlarmThresholds, max_prompts: int, generated: str, frontier: Optional[tuple[str, str, str]],
) -> str:
    title = "ppokit report: " + ", ".join(r.label for r in runs)
    body = [
        f"<h1>{e(title)}</h1>",
        f"<p class=meta>{e(generated)}</p>",
        "<h2 id=runs>Runs</h2>", runs_table(runs),
        "<h2 id=alarms>Alarms</h2>", alarms_section(runs, alarms),
        "<h2 id=skipped>Skipped</h2>", notes_section(runs, skipped_panels),
    ]
    if frontier:
        body.append(figure_html(*frontier))
    body += [figure_html(*f) for f in figures]
    for run in runs:
        body += [f"<h2 id=\"samples-{e(run.label)}\">Samples: {e(run.label)}</h2>", samples_section(run, max_prompts)]
    body += ["<h2 id=thresholds>Alarm thresholds used</h2>", thresholds_table(thresholds)]
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>{e(title)}</title>\n"
        f"<style>{STYLE}</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n"
    )
