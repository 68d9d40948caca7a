"""Where the report goes: never over a file of a run it reads."""

from __future__ import annotations

from pathlib import Path

from ppokit.errors import UserError

PAGE_SUFFIXES = (".html", ".htm")


def figure_dir(output: Path) -> Path:
    return output.with_name(output.stem + "_figures")


def check_output(output: Path, run_paths: list[Path]) -> None:
    """UserError when the page or its figure folder would be, or lie inside, one of the runs' files.
    A run folder may hold its report only as a page directly in it named *.html (runs write no such
    name), with the figure folder beside it; paths are compared resolved, so a symlink cannot
    redirect either into the run."""
    page, figures = output.resolve(), figure_dir(output).resolve()
    for run in run_paths:
        root = run.resolve()
        inside = [t for t in (page, figures) if t == root or root in t.parents]
        beside = (page.parent == root and page.suffix.lower() in PAGE_SUFFIXES
                  and figures.parent == root and figures.name == page.stem + "_figures")
        if inside and not beside:
            raise UserError(
                f"report output {output} would write into the files of run {run}, which the report reads: "
                f"give a path outside it, or a page directly in it named *.html (e.g. {run / 'report.html'})"
            )
