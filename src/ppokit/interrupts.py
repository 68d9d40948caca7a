"""Ctrl-C for the `ppokit` program: SIGINT acted on from the first line, and never lost in a finaliser.

Two ways a SIGINT used to go unheard, with the process running on as if nothing had been sent:

- **Inherited ignored.** A shell without job control (a script, CI, `nohup cmd &`) starts background jobs with
  SIGINT ignored, and Python then installs no KeyboardInterrupt handler. The trainer's own handler
  (`guards.StopSignals`) takes SIGINT in any case once training starts, so such a run ignored a Ctrl-C or
  `kill -INT` while it imported and loaded models, then obeyed it during training. The program now acts on
  SIGINT from the start, as it does during training.
- **Raised inside a finaliser.** KeyboardInterrupt is raised wherever Python code runs when the signal
  arrives; inside a `__del__` (regex's `_regex_core` has one, run while transformers compiles its patterns)
  Python cannot propagate it: it prints "Exception ignored in ..." with a traceback and drops it. Such an
  interrupt is sent again here (by a thread, once the main thread is out of the finaliser), to land in the
  program's own code.

Only the standard library: installed before any heavy import.
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
import time

from ppokit.errors import TrainingInterrupted


def act_on_ctrl_c() -> None:
    """For the program itself (not a call of `cli.main` in-process, whose caller owns its process's handlers)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        signum = _signal_of(unraisable.exc_value)
        if signum is None:
            previous(unraisable)
        else:
            try:
                _thread.start_new_thread(_send_again, (signum, hook.__code__))
            except RuntimeError:  # the interpreter is shutting down: nothing left to interrupt
                pass

    sys.unraisablehook = hook


def _send_again(signum: int, hook_code) -> None:
    """The signal to the main thread again, once it has left the hook and any finaliser. Not from the hook itself: the
    interpreter runs a handler at its next check, which would be inside the hook, where it is dropped once more."""
    main = threading.main_thread().ident
    deadline = time.monotonic() + 1.0  # a finaliser that runs on is interrupted anyway: one more round at worst
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(main)
        if frame is None:
            return  # the interpreter is shutting down
        if not any(f.f_code is hook_code or f.f_code.co_name == "__del__" for f in _stack(frame)):
            break
        time.sleep(0.001)
    _thread.interrupt_main(signum)


def _stack(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


def _signal_of(error: BaseException | None) -> int | None:
    """The signal whose handler raised `error`: KeyboardInterrupt (SIGINT), or a second SIGINT/SIGTERM of a run (guards.StopSignals)."""
    if isinstance(error, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(error, TrainingInterrupted):
        return signal.Signals[error.signal_name]
    return None
