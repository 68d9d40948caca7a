"""Ctrl-C for the `ppokit` program: SIGINT acted on from the first line, one line and exit 130, never lost, never
an abort.

Python raises KeyboardInterrupt wherever Python code runs when SIGINT arrives. Three places made that go wrong:

- **Inherited ignored.** A shell without job control (a script, CI, `nohup cmd &`) starts background jobs with
  SIGINT ignored, and Python then installs no KeyboardInterrupt handler. The trainer's own handler
  (`guards.StopSignals`) takes SIGINT in any case once training starts, so such a run ignored a Ctrl-C or
  `kill -INT` while it imported and loaded models, then obeyed it during training. The program now acts on
  SIGINT from the start, as it does during training.
- **Inside a finaliser.** Python cannot propagate an exception out of a `__del__` (regex's `_regex_core` has
  one, run while transformers compiles its patterns): it printed "Exception ignored in ..." with a traceback,
  dropped the interrupt and ran on.
- **Inside an import.** Extension modules call back into Python while they initialise (torch's, through
  pybind11); a KeyboardInterrupt raised in such a callback reached C++ code that cannot pass it on:
  "terminate called after throwing an instance of 'pybind11::error_already_set'", SIGABRT.

So SIGINT that arrives inside a finaliser or an import is held, and sent to the main thread again (by a helper
thread) once it is out of them: the import finishes, then the program stops. A second SIGINT while one is held
raises at once (the user insists). KeyboardInterrupt dropped in another finaliser (a weakref callback) reaches
`sys.unraisablehook`, and is sent again the same way.

Only the standard library: installed before any heavy import.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from ppokit.errors import TrainingInterrupted

_held = False  # a SIGINT is held for the main thread to leave a finaliser or an import


def act_on_ctrl_c() -> None:
    """For the program itself (not a call of `cli.main` in-process, whose caller owns its process's handlers)."""
    signal.signal(signal.SIGINT, _on_sigint)
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        signum = _signal_of(unraisable.exc_value)
        if signum is None:
            previous(unraisable)
        else:
            _send_when_safe(signum)

    sys.unraisablehook = hook


def _on_sigint(signum, frame) -> None:
    global _held
    if not _held and _unsafe(frame):
        _held = True
        _send_when_safe(signum)
        return
    _held = False
    raise KeyboardInterrupt


def _unsafe(frame) -> bool:
    """Whether an exception raised in `frame` may not reach the program's own code: a finaliser, an import (an extension
    module's callbacks), or this module's hook (called inside a finaliser) is running."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in ("__del__", "hook") and (code.co_name == "__del__" or code.co_filename == __file__):
            return True
        if code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _send_when_safe(signum: int) -> None:
    try:
        threading.Thread(target=_send_again, args=(signum,), name="ppokit-ctrl-c", daemon=True).start()
    except RuntimeError:  # the interpreter is shutting down: nothing left to interrupt
        pass


def _send_again(signum: int) -> None:
    """`signum` to the main thread once it is out of finalisers and imports. A real signal to that thread (not
    `_thread.interrupt_main`), so that a blocking call there (a sleep, a read) is interrupted too."""
    main = threading.main_thread().ident
    while True:
        frame = sys._current_frames().get(main)
        if frame is None:
            return  # the interpreter is shutting down
        if not _unsafe(frame):
            break
        time.sleep(0.01)
    signal.pthread_kill(main, signum)


def _signal_of(error: BaseException | None) -> int | None:
    """The signal whose handler raised `error`: KeyboardInterrupt (SIGINT), or a second SIGINT/SIGTERM of a run (guards.StopSignals)."""
    if isinstance(error, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(error, TrainingInterrupted):
        return signal.Signals[error.signal_name]
    return None
