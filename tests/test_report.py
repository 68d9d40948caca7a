"""`ppokit report`: alarms on constructed runs, bad and partial run directories, several runs,
the self-contained HTML (and, where Chromium is installed, the page in a real browser)."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
from pathlib import Path
from xml.etree import ElementTree

import pytest
import yaml

from ppokit.errors import UserError
from ppokit.report import AlarmThresholds, find_alarms, make_report, read_run
from test_cli import ppokit

BATCH = 32
SVG = "{http://www.w3.org/2000/svg}"


def healthy_records(n: int = 24, seed: int = 0) -> list[dict]:
    """A run that learns as it should: score up and levelling off, KL rising sublinearly, noise of a batch."""
    rng = random.Random(seed)
    noise = lambda scale: rng.uniform(-scale, scale)  # noqa: E731
    records = []
    for u in range(1, n + 1):
        score = 0.1 + 0.6 * (1 - math.exp(-u / 8)) + noise(0.04)
        kl = 0.4 * math.sqrt(u) + noise(0.1)
        records.append({
            "update": u, "episode": u * BATCH,
            "objective/scores": score, "objective/scores_std": 0.4 + noise(0.03), "objective/kl": kl,
            "objective/entropy": 13 + noise(1), "objective/non_score_reward": -0.05 * kl, "objective/rlhf_reward": score - 0.05 * kl,
            "objective/kl_coef": 0.05, "objective/response_length": 8.5 + noise(0.6), "val/num_eos_tokens": BATCH - rng.randrange(2),
            "policy/approxkl_avg": 0.02 + noise(0.01), "policy/clipfrac_avg": 0.05 + noise(0.02), "loss/policy_avg": -0.01 + noise(0.005),
            "loss/value_avg": 0.1 + noise(0.02), "val/clipfrac_avg": 0.01, "policy/entropy_avg": 1.6 + noise(0.08),
            "val/ratio": 1 + noise(0.01), "val/ratio_var": 0.001, "reward/sentiment": score, "reward/skipped": 0,
            "lr": 3e-4 * (1 - (u - 1) / n), "eps": 12 + noise(1), "time/update": 2.5, "skipped_updates": 0,
        })
    for u in (8, 16, 24):
        if u <= n:
            records[u - 1]["eval/scores"] = records[u - 1]["objective/scores"] + 0.05
    return records


def sample_rows(updates=(8, 16, 24), completion=lambda u, k: f"pretty good and fun number {k} .", score=lambda u, k: 0.5) -> list[dict]:
    return [{"update": u, "episode": u * BATCH, "split": "eval", "prompt": f"prompt {k}", "completion": completion(u, k), "score": score(u, k)}
            for u in updates for k in range(4)]


CONFIG = {"model": "sft", "reward": {"functions": ["sentiment"], "normalize": False},
          "ppo": {"kl_coef": 0.05, "response_length": 16, "total_episodes": 24 * BATCH}}


def write_run(path: Path, records, samples=None, config=CONFIG, finished=True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / "config.yaml").write_text(yaml.safe_dump(config))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (samples if samples is not None else sample_rows())))
    if finished:
        (path / "final").mkdir(exist_ok=True)
    return path


def alarms_of(tmp_path, records, samples=None, config=CONFIG, **thresholds):
    run = read_run(write_run(tmp_path / "run", records, samples, config))
    return find_alarms(run, AlarmThresholds(**thresholds))


def only(alarms, kind):
    assert [a.kind for a in alarms] == [kind], [(a.kind, a.update, a.evidence) for a in alarms]
    return alarms[0]


# --------------------------------------------------------------------------- alarms on constructed runs


@pytest.mark.parametrize("seed", range(5))
def test_healthy_run_has_no_alarm(tmp_path, seed):
    assert alarms_of(tmp_path, healthy_records(seed=seed)) == []


def test_kl_explosion_at_update_7_is_named(tmp_path):
    records = healthy_records(16)
    for r in records:
        u = r["update"]
        r["objective/kl"] = 0.1 * u if u < 7 else 0.6 * 2 ** (u - 6)  # 0.1 per update, then doubling from update 7
    alarm = only(alarms_of(tmp_path, records), "kl_superlinear")
    assert alarm.update == 7
    assert "the steep rise starts at update 7: 1.2 at update 7, 2.4 at update 8" in alarm.evidence and "kl_coef" in alarm.advice


def test_kl_step_that_levels_off_is_not_a_runaway(tmp_path):
    """The demo's shape: KL climbs from ~0 over a few updates, then stays level."""
    records = healthy_records(24)
    for r, kl in zip(records, [0, 0.35, 0.11, 0.3, 1.2, 1.68, 2.18, 1.45, 1.58, 1.5, 2.09, 2.37, 1.54, 1.54, 2.12, 1.51]):
        r["objective/kl"] = kl
    for r in records[16:]:
        r["objective/kl"] = 2.0
    assert alarms_of(tmp_path, records) == []


def test_response_length_drift(tmp_path):
    records = healthy_records()
    for r in records[10:]:
        r["objective/response_length"] = 8.5 + 2 * (r["update"] - 10)  # 12.5 at update 12, 14.5 at 13
    alarm = only(alarms_of(tmp_path, records), "length_drift")
    assert alarm.update == 13  # the first update past 50% (12.75 tokens), and the next one too
    assert "grew from" in alarm.evidence


def test_length_pinned_at_response_length_with_the_stop_rate_collapsing(tmp_path):
    records = healthy_records()
    for r in records[11:]:
        r["objective/response_length"] = 16.0
        r["val/num_eos_tokens"] = 3
    alarms = alarms_of(tmp_path, records, length_drift=1.0)  # length_drift=1.0: only the pinned alarm
    alarm = only(alarms, "length_pinned")
    assert alarm.update == 12
    assert "ppo.response_length 16" in alarm.evidence and "missing_eos_penalty" in alarm.advice


def test_entropy_collapse(tmp_path):
    records = healthy_records()
    for r in records[9:]:
        r["policy/entropy_avg"] = 0.2
    alarm = only(alarms_of(tmp_path, records), "entropy_collapse")
    assert alarm.update == 10


def test_repeated_ngrams_rising_in_completions(tmp_path):
    looping = "great great great great great great great great ."
    samples = sample_rows(completion=lambda u, k: looping if u == 24 else f"pretty good and fun number {k} .")
    alarm = only(alarms_of(tmp_path, healthy_records(), samples), "repeated_ngrams")
    assert alarm.update == 24 and looping in alarm.evidence


def test_train_score_rising_while_eval_falls(tmp_path):
    records = healthy_records()
    for u, e in ((8, 0.7), (16, 0.75), (24, 0.45)):
        records[u - 1]["eval/scores"] = e
    alarm = only(alarms_of(tmp_path, records), "train_up_eval_down")
    assert alarm.update == 24 and "update 16" in alarm.evidence


def test_policy_ratio_far_from_one(tmp_path):
    records = healthy_records()
    for r in records[5:8]:
        r["val/ratio"] = 1.5
    assert only(alarms_of(tmp_path, records), "ratio_off").update == 6


def test_clip_fraction_high(tmp_path):
    records = healthy_records()
    for r in records[14:]:
        r["policy/clipfrac_avg"] = 0.45
    assert only(alarms_of(tmp_path, records), "clipfrac_high").update == 15


def test_nonfinite_skips(tmp_path):
    records = healthy_records()
    records[9] = {"update": 10, "episode": 320, "nonfinite/loss": 1, "skipped_updates": 1, "time/update": 1.0}
    for r in records[10:]:
        r["skipped_updates"] = 1
    alarm = only(alarms_of(tmp_path, records), "nonfinite")
    assert alarm.update == 10 and "update 10: loss" in alarm.evidence


def weak_reward_records():
    """A reward in [0, 0.2]: a batch's scores spread by ~0.03 while kl_coef x KL reaches 0.05 x 1.5."""
    records = healthy_records()
    for r in records:
        r["objective/scores"] = 0.12 + 0.0005 * r["update"]
        r["objective/scores_std"] = 0.03
    return records


def test_reward_too_weak_for_its_kl_penalty_names_reward_normalize(tmp_path):
    alarm = only(alarms_of(tmp_path, weak_reward_records()), "weak_reward")
    # judged over updates 4-12 (the first half of 24): spread 0.03 against 0.05 x 0.4 x sqrt(u), median 0.057
    assert alarm.update == 12 and "over updates 4-12" in alarm.evidence
    assert "`reward.normalize: true`" in alarm.advice and "0.12 -> 0.18" in alarm.advice


def test_weak_reward_with_normalize_already_on_says_to_lower_kl_coef(tmp_path):
    config = {**CONFIG, "reward": {"functions": ["sentiment"], "normalize": True}}
    alarm = only(alarms_of(tmp_path, weak_reward_records(), config=config), "weak_reward")
    assert "already on" in alarm.advice and "ppo.kl_coef" in alarm.advice


def test_weak_reward_does_not_fire_on_a_run_that_converged(tmp_path):
    """Every sample near the top score spreads little, but the score rose by far more than its spread."""
    records = healthy_records()
    for r in records[12:]:
        r["objective/scores_std"] = 0.02
    samples = sample_rows(score=lambda u, k: 0.9 + 0.01 * k)
    assert alarms_of(tmp_path, records, samples) == []


def test_weak_reward_from_sample_scores_when_the_run_has_no_scores_std(tmp_path):
    records = weak_reward_records()
    for r in records:
        del r["objective/scores_std"]
    samples = sample_rows(score=lambda u, k: 0.1 + 0.02 * k)  # std 0.022 at each generation
    alarm = only(alarms_of(tmp_path, records, samples), "weak_reward")
    assert alarm.update == 12 and "samples.jsonl" in alarm.evidence  # the generation at update 8


def test_thresholds_are_configurable(tmp_path):
    records = healthy_records()
    for r in records[14:]:
        r["policy/clipfrac_avg"] = 0.45
    assert alarms_of(tmp_path, records, clipfrac_max=0.5) == []
    with pytest.raises(UserError, match="clipfrac_mx"):
        AlarmThresholds.from_mapping({"clipfrac_mx": 0.5})
    with pytest.raises(UserError, match="clipfrac_max"):
        AlarmThresholds.from_mapping({"clipfrac_max": 2})


# --------------------------------------------------------------------------- the report and its inputs


def test_report_of_a_healthy_run_says_no_alarms_and_is_self_contained(tmp_path):
    run = write_run(tmp_path / "run", healthy_records())
    summary = make_report([run], tmp_path / "out" / "report.html")
    page = Path(summary["output"]).read_text()
    assert "no alarms (24 updates checked)" in page
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", page)  # no request to anywhere
    drawings = re.findall(r"<svg .*?</svg>", page, re.S)  # inline, each the same as its file
    assert len(drawings) == len(summary["figures"]) >= 6
    for drawing, path in zip(drawings, summary["figures"]):
        assert drawing.encode() == Path(path).read_bytes()
        root = ElementTree.fromstring(drawing)
        assert root.tag == SVG + "svg" and float(root.get("width")) > 300
    assert {Path(p).name for p in summary["figures"]} == {f"{name}.svg" for name in ("frontier", "score", "kl", "policy", "length", "value", "run")}
    assert "<script" not in page and " id=" not in "".join(drawings)  # ids would clash between drawings on one page
    # the samples of each fixed eval prompt at each generation
    assert page.count("<h3>prompt: prompt 0</h3>") == 1 and "pretty good and fun number 0" in page
    assert "explained variance" in " ".join(summary["skipped"])  # not logged by this run: said, not drawn


def test_report_names_alarms_with_update_and_evidence(tmp_path):
    records = healthy_records(16)
    for r in records:
        r["objective/kl"] = 0.1 * r["update"] if r["update"] < 7 else 0.6 * 2 ** (r["update"] - 6)
    summary = make_report([write_run(tmp_path / "run", records)], tmp_path / "report.html")
    assert summary["runs"][0]["alarms"] == [{"kind": "kl_superlinear", "update": 7, "title": "KL growing faster than linear"}]
    page = (tmp_path / "report.html").read_text()
    assert "update 7: KL growing faster than linear" in page


def test_critic_free_run_skips_value_curves_and_says_so(tmp_path):
    records = healthy_records()
    for r in records:
        del r["loss/value_avg"], r["val/clipfrac_avg"]
    summary = make_report([write_run(tmp_path / "run", records)], tmp_path / "report.html")
    assert any("value loss" in s and "critic-free" in s for s in summary["skipped"]), summary["skipped"]


def test_truncated_last_line_and_run_in_progress(tmp_path):
    run = write_run(tmp_path / "run", healthy_records(10), finished=False)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"update": 11, "episode": 352, "objective/sco')  # killed mid-write
    summary = make_report([run], tmp_path / "report.html")
    assert summary["runs"][0]["updates"] == 10
    assert summary["runs"][0]["skipped"] == ["metrics.jsonl: skipped line 11: the last line is cut short (a run stopped mid-write)"]
    page = (tmp_path / "report.html").read_text()
    assert "not finished (in progress, stopped or crashed): 10 of 24 updates" in page and "cut short" in page


def test_empty_metrics_renders_and_says_what_is_missing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    (run / "metrics.jsonl").write_text("")
    summary = make_report([run], tmp_path / "report.html")
    notes = summary["runs"][0]["skipped"]
    assert "metrics.jsonl: no update recorded yet; no curves or metric alarms" in notes
    assert any(n.startswith("samples.jsonl: missing") for n in notes)
    assert summary["figures"] == [] and "no alarms (no metrics to check)" in (tmp_path / "report.html").read_text()


def test_several_runs_overlaid_with_distinct_labels(tmp_path):
    a = write_run(tmp_path / "kl0.05" / "ppo", healthy_records(seed=1))
    b = write_run(tmp_path / "kl0.2" / "ppo", healthy_records(seed=2), config={**CONFIG, "ppo": {**CONFIG["ppo"], "kl_coef": 0.2}})
    not_a_run = tmp_path / "notes"
    not_a_run.mkdir()
    summary = make_report([a, b, not_a_run], tmp_path / "report.html")
    assert [r["label"] for r in summary["runs"]] == ["kl0.05/ppo", "kl0.2/ppo"]
    assert any("notes: not a run directory" in s for s in summary["skipped"])
    page = (tmp_path / "report.html").read_text()
    assert "Samples: kl0.05/ppo" in page and "Samples: kl0.2/ppo" in page and "<td class=num>0.200</td>" in page


def panels_of(drawing: str) -> dict[str, ElementTree.Element]:
    """The panels (`<g class="panel">`) of an SVG drawing, by title."""
    root = ElementTree.fromstring(drawing)
    return {g.find(f"{SVG}text[@class='title']").text: g for g in root.iter(f"{SVG}g") if g.get("class") == "panel"}


def of_class(element: ElementTree.Element, tag: str, name: str) -> list[ElementTree.Element]:
    return [e for e in element.iter(SVG + tag) if e.get("class") == name]


def legend_of(panel: ElementTree.Element) -> list[str]:
    return [t.text for t in of_class(panel, "text", "entry")]


def axis(panel: ElementTree.Element, name: str):
    """(pixel -> value, value units per pixel) of axis `name` ("x" or "y"), read from its first and last tick:
    the grid line's position and the label's number."""
    pixels = [float(line.get(f"{name}1")) for line in of_class(panel, "line", f"{name}grid")]
    values = [float(t.text) for t in of_class(panel, "text", f"{name}tick")]
    assert len(pixels) == len(values) >= 2
    (p0, v0), (p1, v1) = (pixels[0], values[0]), (pixels[-1], values[-1])
    return (lambda p: v0 + (p - p0) * (v1 - v0) / (p1 - p0)), abs((v1 - v0) / (p1 - p0))


def read_back(panel: ElementTree.Element) -> tuple[list[list[tuple[float, float]]], list[tuple[float, float]], float, float]:
    """The panel's polylines and markers in data units, and the tolerance on x and y: 0.2 pixel (coordinates
    are written to 0.1 pixel, the ticks too)."""
    x, x_unit = axis(panel, "x")
    y, y_unit = axis(panel, "y")
    lines = [[(x(float(px)), y(float(py))) for px, py in (p.split(",") for p in line.get("points").split())]
             for line in of_class(panel, "polyline", "series")]
    markers = [(x(float(c.get("cx"))), y(float(c.get("cy")))) for c in of_class(panel, "circle", "marker")]
    return lines, markers, 0.2 * x_unit, 0.2 * y_unit


def assert_at(drawn: list[tuple[float, float]], expected: list[tuple[float, float]], x_tol: float, y_tol: float):
    assert len(drawn) == len(expected), (drawn, expected)
    for (x, y), (u, v) in zip(drawn, expected):
        assert abs(x - u) <= x_tol and abs(y - v) <= y_tol, (drawn, expected)


def test_each_value_is_drawn_at_its_update_and_value_on_the_axes(tmp_path):
    """A hand-made metrics file read back from the SVG through its own tick labels: one point per update,
    a non-finite value a gap in the line, the eval line dashed with a marker at each eval."""
    kl = [0.5, 1.25, math.nan, 2.0, 3.5, math.inf, 4.0, 4.5]
    records = [{"update": u, "episode": BATCH * u, "objective/kl": v, "objective/scores": 0.1 * u} for u, v in enumerate(kl, 1)]
    for r in records[3::4]:
        r["eval/scores"] = 0.2 * r["update"]
    summary = make_report([write_run(tmp_path / "run", records)], tmp_path / "report.html")
    drawing = {Path(p).stem: Path(p).read_text() for p in summary["figures"]}

    panel = panels_of(drawing["kl"])["KL to the reference (objective/kl, nats per sequence)"]
    lines, markers, x_tol, y_tol = read_back(panel)
    assert len(lines) == 3 and markers == [] and legend_of(panel) == []  # one run, one line: no legend
    for line, expected in zip(lines, [[(1, 0.5), (2, 1.25)], [(4, 2.0), (5, 3.5)], [(7, 4.0), (8, 4.5)]]):
        assert_at(line, expected, x_tol, y_tol)

    panel = panels_of(drawing["score"])["score: train (objective/scores) and eval (eval/scores)"]
    lines, markers, x_tol, y_tol = read_back(panel)
    assert_at(lines[0], [(u, 0.1 * u) for u in range(1, 9)], x_tol, y_tol)
    assert_at(lines[1], [(4, 0.8), (8, 1.6)], x_tol, y_tol)
    assert_at(markers, [(4, 0.8), (8, 1.6)], x_tol, y_tol)
    train, evals = of_class(panel, "polyline", "series")
    assert train.get("stroke-dasharray") is None and evals.get("stroke-dasharray") and train.get("stroke") == evals.get("stroke")
    assert legend_of(panel) == ["train", "eval"]
    ticks = [t.text for t in of_class(panel, "text", "xtick")]
    assert ticks == [str(u) for u in range(1, 9)] or ticks == [str(u) for u in range(2, 9, 2)]  # whole updates, a 1-2-5 step


def test_ticks_are_round_numbers_in_steps_of_1_2_or_5():
    from ppokit.report import svg

    assert [label for _, label in svg.ticks(0.0, 1.0, 6)] == ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]
    assert [label for _, label in svg.ticks(-0.013, 0.031, 5)] == ["-0.01", "0.00", "0.01", "0.02", "0.03"]
    assert [label for _, label in svg.ticks(0.5, 48.5, 6, integer=True)] == ["10", "20", "30", "40"]
    assert [label for _, label in svg.ticks(0.5, 3.5, 8, integer=True)] == ["1", "2", "3"]  # never between updates
    assert [label for _, label in svg.ticks(1.0e-5, 3.2e-4, 4)] == ["1e-4", "2e-4", "3e-4"]
    assert [label for _, label in svg.ticks(2.0e6, 3.1e6, 3)] == ["2.0e6", "2.5e6", "3.0e6"]
    with pytest.raises(svg.Unplottable, match="span more than a chart's axis can"):
        svg.axis_limits([-1.7e308, 1.7e308])
    with pytest.raises(svg.Unplottable, match="all NaN or infinite"):
        svg.axis_limits([])


def test_several_runs_keep_one_colour_each_in_every_figure(tmp_path):
    a = write_run(tmp_path / "a", healthy_records(12, seed=1))
    b = write_run(tmp_path / "b", healthy_records(12, seed=2))
    summary = make_report([a, b], tmp_path / "report.html")
    colours: dict[str, set[str]] = {"a": set(), "b": set()}
    for path in summary["figures"]:
        for panel in panels_of(Path(path).read_text()).values():
            for line in of_class(panel, "polyline", "series"):
                colours[line.find(SVG + "title").text.split()[0]].add(line.get("stroke"))
            if Path(path).stem != "frontier":
                assert legend_of(panel)[:2] in (["a", "b"], ["a train", "a eval"], ["a policy", "a value"]), legend_of(panel)
    assert len(colours["a"]) == len(colours["b"]) == 1 and colours["a"] != colours["b"]
    frontier = panels_of(Path(summary["figures"][0]).read_text())
    (panel,) = frontier.values()
    assert legend_of(panel) == ["a (mean of 5 updates)", "a eval score", "b (mean of 5 updates)", "b eval score"]
    assert [t.text for t in of_class(panel, "text", "note")] == ["update 12", "update 12"]  # where each path ends


def test_run_names_and_metric_keys_are_escaped_in_the_page_and_its_charts(tmp_path):
    """Run names (run_name) and reward source names (metric keys) are the user's: they come out as text."""
    evil = """<script>alert(1)</script> & "q" 's"""
    key = "reward/<img src=x onerror=alert(2)>"
    records = healthy_records(8)
    for r in records:
        r[key] = 0.5 + 0.01 * r["update"]
    a = write_run(tmp_path / "a", records, config={**CONFIG, "run_name": evil})
    b = write_run(tmp_path / "b", healthy_records(8, seed=1))
    summary = make_report([a, b], tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert "<script" not in page and "<img" not in page
    score = panels_of(Path(summary["figures"][1]).read_text())  # the files parse as XML; the texts read back whole
    assert legend_of(score[f"{key} (raw score of the source)"]) == [evil]
    assert legend_of(score["score - beta x KL (objective/rlhf_reward)"]) == [evil, "b"]


def test_a_normalised_runs_scores_are_labelled_where_they_meet_raw_scores(tmp_path):
    """With reward.normalize the scores are z-scores: overlaid on a raw run's, unlabelled, they read as
    the same scale. Read back from the SVG figures the report draws and from its table."""
    from ppokit.report import figures
    from ppokit.report.page import runs_table

    raw = read_run(write_run(tmp_path / "raw", healthy_records(seed=1)))
    normalised = {**CONFIG, "reward": {"functions": ["sentiment"], "normalize": [True]}}
    norm = read_run(write_run(tmp_path / "norm", healthy_records(seed=2), config=normalised))
    assert (raw.normalised_scores, norm.normalised_scores) == (False, True)
    mark = "normalised (reward.normalize)"

    spec = next(s for s in figures.figure_specs([raw, norm]) if s.name == "score")
    legends = {title: legend_of(panel) for title, panel in panels_of(figures.draw_curves(spec, [raw, norm], [], skipped=[])).items()}
    assert legends["score: train (objective/scores) and eval (eval/scores)"] == [
        "raw train", "raw eval", f"norm train {mark}", f"norm eval {mark}"]
    assert legends["score - beta x KL (objective/rlhf_reward)"] == ["raw", f"norm {mark}"]
    assert legends["reward/sentiment (raw score of the source)"] == ["raw", "norm"]  # raw in both runs
    (frontier,) = panels_of(figures.draw_frontier([raw, norm], [])).values()
    assert legend_of(frontier) == ["raw (mean of 5 updates)", "raw eval score", f"norm {mark} (mean of 5 updates)", f"norm eval score {mark}"]

    alone = panels_of(figures.draw_curves(spec, [norm], [], skipped=[]))  # one run: its lines say it too
    assert legend_of(alone["score: train (objective/scores) and eval (eval/scores)"]) == [f"train {mark}", f"eval {mark}"]
    (frontier,) = panels_of(figures.draw_frontier([norm], [])).values()
    assert legend_of(frontier) == [f"train score {mark}, one point per update", "path (mean of 5 updates)", f"eval score {mark}"]
    assert "(normalised)</td>" in runs_table([norm]) and "(normalised)" not in runs_table([raw])


def test_cli_report_on_a_folder_that_is_not_a_run_is_one_line(tmp_path):
    (tmp_path / "runs" / "a").mkdir(parents=True)
    write_run(tmp_path / "runs" / "ppo", healthy_records(4))
    result = ppokit("report", tmp_path / "runs", "--output", tmp_path / "r.html")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"ppokit: error: {tmp_path / 'runs'}: not a run directory (none of config.yaml, metrics.jsonl, samples.jsonl); "
        f"runs inside it: {tmp_path / 'runs' / 'ppo'}"
    ]
    assert not (tmp_path / "r.html").exists()


def test_cli_report_output_and_samples_mistakes_are_one_line(tmp_path, capsys):
    """An --output that is a folder (or under a file) and a negative --samples were a traceback, a
    leftover `.partial`, or a page silently missing its last prompt."""
    from ppokit.cli import main

    run = write_run(tmp_path / "run", healthy_records(4))
    (tmp_path / "file").write_text("")
    for args, line in [(["--output", str(tmp_path)], f"report output {tmp_path} is a folder; give the HTML file's name, e.g. {tmp_path / 'report.html'}"),
                       (["--output", str(tmp_path / "file" / "r.html")], f"report output {tmp_path / 'file' / 'r.html'}: cannot make"),
                       (["--samples", "-1", "--output", str(tmp_path / "r.html")], "--samples -1: must be 0 or more")]:
        assert main(["report", str(run), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"ppokit: error: {line}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "run"]


def test_cli_report_thresholds_from_yaml_and_flags(tmp_path, capsys):
    from ppokit.cli import main

    records = healthy_records()
    for r in records[14:]:
        r["policy/clipfrac_avg"] = 0.45
    run = write_run(tmp_path / "run", records)
    (tmp_path / "t.yaml").write_text("clipfrac_max: 0.5\n")
    assert main(["report", str(run), "--output", str(tmp_path / "a.html"), "--thresholds", str(tmp_path / "t.yaml")]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["alarms"] == []
    assert main(["report", str(run), "--output", str(tmp_path / "b.html"), "--thresholds", str(tmp_path / "t.yaml"),
                 "--threshold", "clipfrac_max=0.4"]) == 0
    loud = capsys.readouterr()
    assert [a["kind"] for a in json.loads(loud.out)["runs"][0]["alarms"]] == ["clipfrac_high"]
    assert "update 15: Clip fraction high" in loud.err
    assert main(["report", str(run), "--threshold", "clipfrac=0.4"]) == 2
    assert "unknown config key clipfrac (did you mean clipfrac_max?)" in capsys.readouterr().err


def run_files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and not p.is_symlink()}


def test_report_output_never_replaces_a_file_of_a_run_it_reads(tmp_path, capsys):
    """`--output RUN/metrics.jsonl` exited 0 having replaced the run's metrics with the page. A run folder
    may hold a report only as a new *.html page directly in it (a run writes no such name)."""
    from ppokit.cli import main

    run = write_run(tmp_path / "run", healthy_records(4))
    (run / "checkpoints" / "update-2").mkdir(parents=True)
    (run / "link.html").symlink_to(run / "metrics.jsonl")  # resolved: it is the metrics file
    (run / "redirected_figures").symlink_to(run / "checkpoints")  # its figures would land in checkpoints/
    before = run_files(run)
    for output in ("metrics.jsonl", "config.yaml", "samples.jsonl", "final", "final/r.html", "checkpoints/update-2/r.html",
                   "new/r.html", "link.html", "redirected.html", "."):
        assert main(["report", str(run), "--output", str(run / output)]) == 2, output
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("ppokit: error: report output "), err
        assert "is a folder" in err if output in (".", "final") else f"would write into the files of run {run}, which the report reads" in err
    other = write_run(tmp_path / "other", healthy_records(4))  # among several runs, any one counts
    assert main(["report", str(other), str(run), "--output", str(run / "samples.jsonl")]) == 2
    assert f"would write into the files of run {run}," in capsys.readouterr().err
    assert run_files(run) == before
    assert main(["report", str(run), "--output", str(run / "report.html")]) == 0  # a new page beside the run's files
    assert main(["report", str(run), "--output", str(run / "report.html")]) == 0  # and again: the report's own page
    capsys.readouterr()
    after = run_files(run)
    assert {name: data for name, data in after.items() if not name.startswith("report")} == before
    assert "report.html" in after and "report_figures/score.svg" in after


def test_damaged_metric_values_and_config_are_skipped_and_said(tmp_path):
    """`"episode": null`, a string where a number belongs, `update` 10**400, numbers at the float limit and
    `reward.functions: 7` were tracebacks. As for a damaged line, what cannot be used is left out and said."""
    records = healthy_records(8)
    records[0]["episode"] = None
    records[2]["objective/kl"] = "high"
    records[3]["reward/skipped"] = [1]
    records[4]["eps"] = 10**400  # JSON integers have no limit; no float holds it
    for r in records:
        r["loss/policy_avg"] = 1.7e308 * (-1) ** r["update"]  # finite, but no chart axis spans it
        r["policy/entropy_avg"] = 1.7e308  # finite, but their mean (an alarm's baseline) is not
    run = write_run(tmp_path / "run", records, config={**CONFIG, "reward": {"functions": 7}})
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"update": 1' + "0" * 400 + ', "episode": 9}\n{"update": -1, "episode": 9}\n')
    summary = make_report([run], tmp_path / "report.html")
    assert summary["runs"][0]["updates"] == 8
    assert summary["runs"][0]["skipped"] == [
        "metrics.jsonl: skipped lines 9-10: no integer `update` from 0 to 9007199254740992",
        "metrics.jsonl: left out values that are not numbers: episode (line 1); objective/kl (line 3); reward/skipped (line 4); eps (line 5)",
    ]
    # a panel whose values no axis can span is left out and said; the rest of its figure is drawn
    assert "policy loss (loss/policy_avg): not drawn, its values (from -1.7e+308 to 1.7e+308) span more than a chart's axis can" in summary["skipped"]
    assert "entropy per token (policy/entropy_avg): not drawn, its values (from 1.7e+308 to 1.7e+308) span more than a chart's axis can" in summary["skipped"]
    figure = {Path(f).stem: Path(f) for f in summary["figures"]}
    assert list(panels_of(figure["value"].read_text())) == ["value loss (loss/value_avg)"]
    lines, _, x_tol, _ = read_back(panels_of(figure["run"].read_text())["episodes per second (eps)"])
    assert [round(x) for x, _ in lines[0]] == [1, 2, 3, 4, 6, 7, 8]  # eps of update 5 (10**400) left out
    assert "<td>7</td>" in (tmp_path / "report.html").read_text()  # the reward source, as config.yaml has it


def test_report_onto_a_full_disk_or_into_a_read_only_folder_is_one_line_and_leaves_nothing_half_written(tmp_path):
    """Both were a traceback, the full disk with a partial PNG left. The page and its figures are written to
    temporary names and renamed into place only once all are written: the earlier report stays whole.
    A full disk and a read-only folder are real tmpfs mounts where a private mount namespace is allowed;
    elsewhere a file size limit (EFBIG, as `ulimit -f`) stands for the full disk and permission bits
    for the read-only folder (root ignores those: skipped)."""
    from test_run_dir import one_error_line, ppokit_on_a_mount, private_mount_namespace, run_ppokit, tree

    run = write_run(tmp_path / "run", healthy_records(8))
    folder = tmp_path / "mnt"
    folder.mkdir()

    def error_and_what_is_left(code: int, err: str) -> tuple[str, str]:
        *lines, left = err.rstrip("\n").split("\n")
        assert code == 2 and left.startswith("left:"), err
        return one_error_line("\n".join(lines)), left.removeprefix("left:").strip()

    page = folder / "report.html"
    if private_mount_namespace():  # the figures (4-12 kB each) do not fit in 16 kB
        line, left = error_and_what_is_left(*ppokit_on_a_mount("size=16k", folder, "report", run, "--output", page))
        assert line.startswith(f"ppokit: error: report output {page}: cannot write {folder / 'report_figures'}/"), line
        assert line.endswith(".svg (No space left on device)") and left == "", (line, left)
        line, left = error_and_what_is_left(*ppokit_on_a_mount("ro,size=16k", folder, "report", run, "--output", page))
        assert line == f"ppokit: error: report output {page}: cannot make {folder / 'report_figures'} (Read-only file system)"
        assert left == ""
    else:
        make_report([run], page)  # an earlier complete report, kept whole
        before = tree(folder)
        code, _, err = run_ppokit("report", run, "--output", page, "--samples", "1", limit_file_size=32 * 1024)
        assert code == 2, err
        line = one_error_line(err)
        assert line.startswith(f"ppokit: error: report output {page}: cannot write ") and line.endswith(" (File too large)"), line
        assert tree(folder) == before
        if os.geteuid() == 0:
            pytest.skip("root ignores permission bits, and no private mount namespace to mount a read-only folder")
        shutil.rmtree(folder)
        folder.mkdir(mode=0o555)
        try:
            code, _, err = run_ppokit("report", run, "--output", page)
        finally:
            folder.chmod(0o755)
        assert code == 2 and one_error_line(err) == f"ppokit: error: report output {page}: cannot make {folder / 'report_figures'} (Permission denied)"
        assert list(folder.iterdir()) == []


def test_report_on_a_real_ppo_run(model_dir, prompts_file, tmp_path):
    """A tiny real run (no eval data: samples are training batches), then the report on its directory."""
    from conftest import tiny_ppo_config
    from ppokit.trainer import PPOTrainer

    config = tiny_ppo_config(model_dir(), prompts_file, tmp_path / "run", total_episodes=32)
    records = PPOTrainer(config, show_progress=False).train()
    summary = make_report([tmp_path / "run"], tmp_path / "report.html")
    assert summary["runs"][0]["updates"] == len(records) == 4 and summary["runs"][0]["finished"]
    page = (tmp_path / "report.html").read_text()
    assert "finished: 4 of 4 updates" in page and "training batch at each generation" in page


# --------------------------------------------------------------------------- in a real browser


PROBE = """<script>
window.addEventListener("load", () => {
  const charts = document.querySelectorAll("svg.chart");
  for (const svg of charts) {
    const box = svg.getBoundingClientRect(), lines = svg.querySelectorAll("polyline, circle").length;
    if (box.width < 300 || box.height < 150 || lines === 0) console.error("chart not drawn: " + svg.getAttribute("aria-label"));
  }
  console.log("probe: " + charts.length + " charts");
});
</script>"""


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Chromium is not installed (Debian: apt-get install -y chromium)")
def test_report_renders_in_headless_chromium(tmp_path):
    run = write_run(tmp_path / "run", healthy_records())
    make_report([run], tmp_path / "report.html")
    # The probe reports, as console errors, any chart the browser lays out empty or tiny; the report has no script of its own.
    page = (tmp_path / "report.html").read_text()
    assert "<script" not in page
    (tmp_path / "probed.html").write_text(page.replace("</body>", PROBE + "</body>"))
    shot = tmp_path / "shot.png"
    result = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
         "--window-size=1320,2400", "--virtual-time-budget=5000", f"--screenshot={shot}", (tmp_path / "probed.html").as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    console = [line for line in result.stderr.splitlines() if ":CONSOLE" in line]
    assert any("probe: 7 charts" in line for line in console), result.stderr[-2000:]
    assert [line for line in console if "probe:" not in line] == []
    Image = pytest.importorskip("PIL.Image", reason="reading the screenshot needs Pillow")
    image = Image.open(shot).convert("RGB")
    assert image.size == (1320, 2400)
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 200  # text, tables and charts, not a blank page
    white = max(colours)[0] / (image.size[0] * image.size[1])
    assert white < 0.95


def test_docs_list_every_threshold_with_its_default():
    from ppokit.config.reference import markdown_reference

    docs = (Path(__file__).resolve().parents[1] / "docs" / "report.md").read_text()
    assert markdown_reference(AlarmThresholds) in docs, "regenerate the thresholds table of docs/report.md"
    for kind in ("kl_superlinear", "length_drift", "length_pinned", "entropy_collapse", "repeated_ngrams",
                 "train_up_eval_down", "ratio_off", "clipfrac_high", "nonfinite", "weak_reward"):
        assert f"(`{kind}`)" in docs


def test_the_report_imports_nothing_of_the_trainer():
    """It reads run directories only, so runs from other machines and versions work: its modules import
    the config machinery, errors and the version, nothing that trains."""
    import ast

    allowed = {"ppokit.config.schema", "ppokit.errors", "ppokit.version"}
    package = Path(__file__).resolve().parents[1] / "src" / "ppokit" / "report"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ppokit"):
                assert node.module in allowed or node.module.startswith("ppokit.report"), f"{path.name} imports {node.module}"
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("ppokit") and not a.name.startswith("ppokit.report") for a in node.names), path.name


def test_samples_of_multi_turn_episodes_show_their_turns_marked(tmp_path):
    from ppokit.report.page import samples_section

    turns = [{"role": "assistant", "text": "8"}, {"role": "user", "text": "higher <b>"}, {"role": "assistant", "text": "12"},
             {"role": "user", "text": "low", "cut": True}]
    samples = sample_rows()
    samples[0] = {**samples[0], "completion": "8 higher <b> 12 low", "turns": turns}
    html = samples_section(read_run(write_run(tmp_path / "run", healthy_records(), samples)), max_prompts=2)
    assert "<b>assistant:</b> 8<br><b>user:</b> higher &lt;b&gt;<br><b>assistant:</b> 12" in html
    assert "<b>user:</b> low <i>(cut by the token budget)</i>" in html  # an observation cut by rollout.max_episode_tokens
    assert "pretty good and fun number 1 ." in html  # single-turn rows as before


def game_run(tmp_path: Path) -> Path:
    """A multi-turn run as the guess demo writes it: the environment the only reward source, episode metrics,
    eval games before training (update 0) and after, each model turn with its step's reward."""
    records = healthy_records(12)
    for r in records:
        u = r.pop("update")
        r.pop("reward/sentiment")
        r.update({"update": u, "env/done_rate": 0.5 + 0.04 * u, "rollout/turns": 4.2 - 0.06 * u, "rollout/model_tokens": 8 - 0.1 * u,
                  "rollout/observation_tokens": 3.2 - 0.06 * u, "rollout/truncated": 0.0, "reward/environment": 0.5 + 0.04 * u})
    won = [{"role": "assistant", "text": "8", "reward": 0.0}, {"role": "user", "text": "lower"},
           {"role": "assistant", "text": "4", "reward": 1.0, "done": True}]
    lost = [{"role": "assistant", "text": "3", "reward": 0.0}, {"role": "user", "text": "higher"}]
    samples = [{"update": u, "episode": u * BATCH, "split": "eval", "prompt": "guess a number from 1 to 16 .",
                "completion": "8 lower 4", "score": score, "turns": turns}
               for u, score, turns in [(0, 0.0, lost), (0, 1.0, won), (12, 1.0, won), (12, 1.0, won)]]
    config = {"model": "sft", "environment": "ppokit.environments:GuessNumber", "reward": {"functions": [], "length_penalty": 0.02},
              "rollout": {"max_turns": 5}, "ppo": {"kl_coef": 0.01, "response_length": 3, "total_episodes": 12 * BATCH}}
    return write_run(tmp_path / "game", records, samples, config)


def test_a_multi_turn_runs_report_has_its_episode_curves_its_reward_source_and_the_winning_turns(tmp_path):
    summary = make_report([game_run(tmp_path)], tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    figures = {Path(p).stem: Path(p).read_text() for p in summary["figures"]}
    episodes = panels_of(figures["episodes"])
    assert list(episodes) == ["episodes the environment ended (env/done_rate)", "model turns per episode (rollout/turns)",
                              "tokens per episode: the model's and the environment's", "episodes cut by the token budget (rollout/truncated)"]
    lines, _, x_tol, y_tol = read_back(episodes["episodes the environment ended (env/done_rate)"])
    assert_at(lines[0], [(u, 0.5 + 0.04 * u) for u in range(1, 13)], x_tol, y_tol)
    # the runs table's reward column names the environment, the run's only source
    assert "<td>environment ppokit.environments:GuessNumber</td>" in page
    # the eval curve starts before training: update 0, the mean score of the games sampled then (0 and 1)
    score = panels_of(figures["score"])["score: train (objective/scores) and eval (eval/scores)"]
    _, markers, x_tol, y_tol = read_back(score)
    evals = [(u, r["eval/scores"]) for r in healthy_records(12) for u in [r["update"]] if "eval/scores" in r]
    assert_at(markers, [(0, 0.5)] + evals, x_tol, y_tol)
    # the games: each turn marked, the winning one as such, the generation before training named
    assert "(updates 0, 12) (update 0: before training)" in page
    assert "<b>assistant:</b> 4 <i>(reward +1.00; the environment ended the episode)</i>" in page
    assert "<b>assistant:</b> 3<br><b>user:</b> higher" in page  # a turn without reward carries no note


def test_a_single_turn_runs_report_has_no_episode_figure(tmp_path):
    summary = make_report([write_run(tmp_path / "run", healthy_records())], tmp_path / "report.html")
    assert "episodes" not in {Path(p).stem for p in summary["figures"]}
    assert not any("rollout/turns" in s for s in summary["skipped"])  # nothing said about curves a single-turn run never has


def test_the_frontier_notes_of_runs_that_end_together_do_not_cover_each_other(tmp_path):
    from ppokit.report import svg

    runs = [write_run(tmp_path / name, healthy_records(12, seed=1)) for name in ("a", "b", "c")]  # the same curve three times
    summary = make_report(runs, tmp_path / "report.html")
    (panel,) = panels_of(Path(summary["figures"][0]).read_text()).values()
    notes = of_class(panel, "text", "note")
    assert [t.text for t in notes] == ["update 12"] * 3
    baselines = sorted(float(t.get("y")) for t in notes)
    assert all(b - a >= svg.TICK_TEXT for a, b in zip(baselines, baselines[1:])), baselines
    assert len({t.get("x") for t in notes}) == 1  # beside the same last point, one above another


def test_a_run_with_eval_data_samples_its_policy_before_training_without_changing_its_results(model_dir, prompts_file, tmp_path):
    """The first sample generation is update 0 (the policy before any update), drawn with the random states kept:
    the run's metrics are those of the same run without it; samples a caller drew before train() are that generation."""
    from conftest import tiny_ppo_config
    from ppokit.trainer import PPOTrainer

    def run(name, before=None):
        config = tiny_ppo_config(model_dir(), prompts_file, tmp_path / name, total_episodes=32, num_eval_samples=3)
        config.data.eval = str(prompts_file)
        trainer = PPOTrainer(config, show_progress=False)
        if before == "none":
            trainer.samples_before_training = lambda: []  # the run as it was without the generation before training
        drawn = trainer.sample_completions() if before == "caller" else None
        records = [{k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"} for r in trainer.train()]
        samples = [json.loads(line) for line in (tmp_path / name / "samples.jsonl").read_text().splitlines()]
        return records, samples, drawn

    records, samples, _ = run("run")
    without, samples_without, _ = run("without", before="none")
    assert records == without  # every metric the same: the generation before training took nothing from training's stream
    assert [s["update"] for s in samples] == [0] * 3 + [s["update"] for s in samples_without] and samples_without[0]["update"] == 2
    assert [s["split"] for s in samples[:3]] == ["eval"] * 3 and all(isinstance(s["score"], float) for s in samples[:3])
    _, caller_samples, drawn = run("caller", before="caller")
    assert caller_samples[:3] == drawn  # a caller's draw at update 0 is the run's generation before training
    page_summary = make_report([tmp_path / "run"], tmp_path / "report.html")
    assert page_summary["runs"][0]["finished"] and "(update 0: before training)" in (tmp_path / "report.html").read_text()


def test_pass_at_k_and_mean_at_n_are_drawn_at_the_eval_updates(tmp_path):
    """A run with ppo.eval_pass_at_k: one panel with a line per k, read back from the SVG at each eval's update."""
    records = [{"update": u, "episode": BATCH * u, "objective/kl": 0.1 * u, "objective/scores": 0.1 * u} for u in range(1, 9)]
    for r in records[3::4]:
        u = r["update"]
        r.update({"eval/scores": 0.05 * u, "eval/pass@1": 0.05 * u, "eval/pass@4": 0.1 * u, "eval/mean@4": 0.05 * u})
    summary = make_report([write_run(tmp_path / "run", records)], tmp_path / "report.html")
    drawing = {Path(p).stem: Path(p).read_text() for p in summary["figures"]}
    panels = panels_of(drawing["score"])
    panel = panels["eval: pass@k, unbiased over n samples per prompt (eval/pass@k)"]
    lines, markers, x_tol, y_tol = read_back(panel)
    assert legend_of(panel) == ["pass@1", "pass@4"]
    assert_at(lines[0], [(4, 0.2), (8, 0.4)], x_tol, y_tol)
    assert_at(lines[1], [(4, 0.4), (8, 0.8)], x_tol, y_tol)
    assert "eval: mean score over the n samples of each prompt (eval/mean@n)" in panels
    # a run without them draws no such panel
    plain = make_report([write_run(tmp_path / "plain", healthy_records())], tmp_path / "plain.html")
    assert "pass@k" not in Path(next(p for p in plain["figures"] if p.endswith("score.svg"))).read_text()


def test_a_distillation_runs_teacher_kl_is_drawn_beside_the_kl_to_the_reference(tmp_path):
    records = [{"update": u, "episode": BATCH * u, "objective/kl": 0.1 * u, "objective/scores": 0.0, "teacher/kl": 2.0 / u} for u in range(1, 9)]
    summary = make_report([write_run(tmp_path / "run", records)], tmp_path / "report.html")
    drawing = {Path(p).stem: Path(p).read_text() for p in summary["figures"]}
    lines, _, x_tol, y_tol = read_back(panels_of(drawing["kl"])["reverse KL to the teacher per token (teacher/kl)"])
    assert_at(lines[0], [(u, 2.0 / u) for u in range(1, 9)], x_tol, y_tol)
    assert "teacher/kl" not in Path(next(p for p in make_report([write_run(tmp_path / "plain", healthy_records())],
                                                              tmp_path / "plain.html")["figures"] if p.endswith("kl.svg"))).read_text()
