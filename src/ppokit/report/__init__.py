"""`ppokit report RUN_DIR [RUN_DIR ...]`: curves, the reward-vs-KL frontier, samples and alarms of
one or more runs, as one self-contained HTML file with its charts inline as SVG, and each chart as an
SVG file too.

It reads only the run directories (config.yaml, metrics.jsonl, samples.jsonl) and never imports
the trainer, so it works on runs from another machine or an older version, on runs still in
progress and on crashed ones.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Optional, Sequence

from ppokit.errors import UserError
from ppokit.report.alarms import Alarm, AlarmThresholds, find_alarms
from ppokit.report.output import check_output, figure_dir, write_files
from ppokit.report.rundata import RunData, label_runs, read_run

__all__ = ["Alarm", "AlarmThresholds", "RunData", "find_alarms", "make_report", "read_run"]


def make_report(
    run_dirs: Sequence[str | Path],
    output: str | Path = "report.html",
    thresholds: Optional[AlarmThresholds] = None,
    max_prompts: int = 4,
) -> dict:
    """Write the report to `output` and its figures to `<output stem>_figures/*.svg`; returns a summary
    (paths, alarms and what was skipped, per run). A path that is not a run directory is skipped and
    said; when none is a run, UserError."""
    from ppokit.report import figures as fig
    from ppokit.report.page import render_page

    thresholds = thresholds or AlarmThresholds()
    output = Path(output)
    if output.is_dir():
        raise UserError(f"report output {output} is a folder; give the HTML file's name, e.g. {output / 'report.html'}")
    runs: list[RunData] = []
    not_runs: list[str] = []
    for path in run_dirs:
        try:
            runs.append(read_run(path))
        except UserError as error:
            not_runs.append(str(error))
    if not runs:
        raise UserError("; ".join(not_runs) if not_runs else "no run directory given")
    check_output(output, [run.path for run in runs])
    label_runs(runs)
    alarms = [alarm for run in runs for alarm in find_alarms(run, thresholds)]

    rendered, skipped_panels = [], list(not_runs)
    drawing = fig.draw_frontier(runs, skipped_panels)
    frontier = ("frontier", "Reward vs KL frontier", drawing) if drawing else None
    for spec in fig.figure_specs(runs):
        drawing = fig.draw_curves(spec, runs, alarms, skipped_panels)
        if drawing:
            rendered.append((spec.name, spec.title, drawing))
    figures = [(figure_dir(output) / f"{name}.svg", drawing.encode("utf-8")) for name, _, drawing in ([frontier] if frontier else []) + rendered]

    from ppokit.version import __version__

    generated = f"Generated {datetime.datetime.now().isoformat(timespec='seconds')} by ppokit {__version__} from the run directories' files."
    page = render_page(runs, alarms, rendered, skipped_panels, thresholds, max_prompts, generated, frontier)
    write_files(output, figures + [(output, page.encode("utf-8"))])  # a reader never sees half a report
    return {
        "output": str(output),
        "figures": [str(path) for path, _ in figures],
        "runs": [
            {
                "label": run.label,
                "path": str(run.path),
                "updates": len(run.records),
                "finished": run.finished,
                "alarms": [{"kind": a.kind, "update": a.update, "title": a.title} for a in alarms if a.run == run.label],
                "skipped": run.notes,
            }
            for run in runs
        ],
        "skipped": skipped_panels,
    }
