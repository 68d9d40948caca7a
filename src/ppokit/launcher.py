"""What a launcher (torchrun, `accelerate launch`) tells each process of a run, and what a process does
when its launcher is gone.

The launcher speaks through the environment: WORLD_SIZE, RANK and LOCAL_RANK (torchrun), and
ACCELERATE_USE_CPU (accelerate's switch to run on CPU). `check_environment` reads them once, before
accelerate or torch.distributed does: a value they cannot parse is one line naming the variable.

A launched process whose launcher is killed (SIGKILL of torchrun's agent) would otherwise live on: while
it starts it waits in the rendezvous for a store that died with the agent, for torch.distributed's
default timeout of 30 minutes, holding the run lock. `follow_launcher` has the kernel end it with SIGKILL
when the launcher dies (Linux `prctl(PR_SET_PDEATHSIG)`; elsewhere a thread watches the parent process),
as a run killed with SIGKILL is: the next start clears what it left, `--resume` continues from its last
checkpoint. Not SIGTERM, which would let a training run write a checkpoint first: the kernel sends the
signal once for each thread of the launcher that exits, and StopSignals takes a second one as "abandon".

Standard library only: the CLI reads it before torch is imported.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

from ppokit.errors import UserError

# accelerate's parse_flag_from_env (accelerate.utils.str_to_bool) accepts these and raises on anything else
_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _whole_number(name: str, minimum: int) -> Optional[int]:
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise UserError(f"environment variable {name}={text!r}: not a whole number >= {minimum}; "
                        "it is set by the launcher (torchrun, accelerate launch): unset it, or launch through one")
    return value


def processes() -> int:
    """The number of processes the launcher started (WORLD_SIZE; 1 without a launcher), checked."""
    world = _whole_number("WORLD_SIZE", 1)
    return 1 if world is None else world


def check_environment() -> None:
    """Every launcher variable ppokit or accelerate reads is set to something they can read: a UserError
    naming the first that is not."""
    world = processes()
    rank = _whole_number("RANK", 0)
    _whole_number("LOCAL_RANK", 0)
    if rank is not None and rank >= world:
        raise UserError(f"environment variable RANK={rank}: not below WORLD_SIZE={world}; "
                        "both are set by the launcher (torchrun, accelerate launch): unset them, or launch through one")
    flag = os.environ.get("ACCELERATE_USE_CPU")
    if flag is not None and flag.strip().lower() not in _TRUE + _FALSE:
        raise UserError(f"environment variable ACCELERATE_USE_CPU={flag!r}: not a truth value; "
                        "set it to true (run on CPU) or false, or unset it")


def launched() -> bool:
    """Started by torchrun or `accelerate launch` (both run torch's elastic agent, which sets this)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def follow_launcher() -> None:
    """A launched process ends with its launcher (see the module's docstring); no-op without a launcher.
    Raises UserError when the launcher is already gone."""
    if not launched():
        return
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    elif not getattr(follow_launcher, "watching", False):
        follow_launcher.watching = True  # type: ignore[attr-defined]
        threading.Thread(target=_watch_parent, args=(parent,), name="ppokit-launcher-watch", daemon=True).start()
    # The launcher may have died before the signal was asked for: this process was then handed to init
    # (or a subreaper) already.
    if parent == 1 or os.getppid() != parent:
        raise UserError(f"the launcher that started this process (process {os.environ.get('RANK', '?')} of a torchrun run) "
                        "is gone; nothing was trained: start the run again")


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
