"""What ppokit writes for a person to read on stderr, made fit for where stderr goes: a terminal gets
colours and redrawn progress bars; a log file or a pipe gets plain lines, without carriage returns or
terminal escape codes."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from typing import Iterator

TERMINAL_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """What a library prints to stdout (which carries only results) goes to stderr instead, without its
    colour codes where stderr is no terminal. Printed when the block ends."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        text = printed.getvalue()
        if text:
            sys.stderr.write(text if is_terminal(sys.stderr) else TERMINAL_ESCAPE.sub("", text))
            sys.stderr.flush()
