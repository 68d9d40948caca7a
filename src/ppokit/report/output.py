"""Where the report goes: never over a file of a run it reads, and written whole or not at all.

The page and its figures are written to temporary names beside them (`.NAME.partial-PID`) and
renamed into place only once every one is written, page last: a read-only folder or a full disk
leaves the previous report (if any) as it was and no half-written file.
"""

from __future__ import annotations

import contextlib
import os
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


def write_files(output: Path, files: list[tuple[Path, bytes]]) -> None:
    """Write every (path, content), all or none; an OSError (read-only folder, full disk) is a UserError
    naming the file, with every temporary file and every folder made here removed."""
    made: list[Path] = []  # folders created here, removed again on failure
    staged: list[tuple[Path, Path]] = []
    try:
        for path, data in files:
            missing = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
            for folder in reversed(missing):
                try:
                    folder.mkdir()
                except OSError as e:
                    raise UserError(f"report output {output}: cannot make {folder} ({e.strerror})") from None
                made.append(folder)
            temporary = path.with_name(f".{path.name}.partial-{os.getpid()}")
            staged.append((temporary, path))
            try:
                with open(temporary, "wb") as f:
                    f.write(data)
            except OSError as e:
                raise UserError(f"report output {output}: cannot write {path} ({e.strerror})") from None
        for temporary, path in staged:
            try:
                os.replace(temporary, path)  # a symlink at `path` is replaced, not followed
            except OSError as e:
                raise UserError(f"report output {output}: cannot write {path} ({e.strerror})") from None
    except BaseException:
        for temporary, _ in staged:
            with contextlib.suppress(OSError):
                temporary.unlink()
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
