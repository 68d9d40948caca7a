"""What a launcher (torchrun, `accelerate launch`, mpirun) tells each process of a run, checked before any
model loads, and what a process does when its launcher is gone.

Launchers say it in the environment: torchrun (and accelerate's multi-process launcher, which is
torchrun) sets WORLD_SIZE, mpirun PMI_SIZE / OMPI_COMM_WORLD_SIZE / MV2_COMM_WORLD_SIZE. accelerate's
simple launcher - what `accelerate launch --num_processes N` runs without GPUs or `--multi_gpu` -
starts one process and sets MASTER_ADDR/MASTER_PORT for it (accelerate's commands/launch.py,
`prepare_simple_launcher_cmd_env`) but no world size: that one process would train alone, with the
batch of one and twice the updates, and say nothing.

A launched process whose launcher is killed (SIGKILL of torchrun's agent) would otherwise live on: while
it starts it waits in the rendezvous for a store that died with the agent, for torch.distributed's
default timeout of 30 minutes, holding the run lock. `follow_launcher` has the kernel end it with SIGKILL
when the launcher dies (Linux `prctl(PR_SET_PDEATHSIG)`; elsewhere a thread watches the parent process),
as a run killed with SIGKILL is: the next start clears what it left, `--resume` continues from its last
checkpoint. Not SIGTERM, which would let a training run write a checkpoint first: the kernel sends the
signal once for each thread of the launcher that exits, and StopSignals takes a second one as "abandon".

Only the standard library: the command line checks the launch before importing anything heavy.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Mapping

from ppokit.errors import UserError

# In the order accelerate reads them (utils/environment.py, get_cpu_distributed_information).
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
# This process's number, in the order accelerate reads them (get_cpu_distributed_information; torchrun sets RANK).
RANK_VARIABLES = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
# Set by every `accelerate launch` in the processes it starts (and by nothing else).
ACCELERATE_LAUNCH_VARIABLES = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND")
# What accelerate's str_to_bool accepts for ACCELERATE_USE_CPU.
_FLAG_VALUES = ("y", "yes", "t", "true", "on", "1", "n", "no", "f", "false", "off", "0")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
CPU_LAUNCH = "ACCELERATE_USE_CPU=true torchrun --nproc_per_node N -m ppokit ppo CONFIG"


def launched_processes(env: Mapping[str, str] = os.environ) -> int:
    """The number of processes the launcher started (1 without a launcher). A value that is not a whole
    number >= 1 is a UserError naming the variable."""
    for name in WORLD_SIZE_VARIABLES:
        if name in env:
            text = env[name]
            try:
                value = int(text)
            except ValueError:
                value = 0
            if value < 1:
                raise UserError(f"{name}={text!r} in the environment is not a number of processes (a whole number >= 1); "
                                f"the launcher sets it: unset it for one process, or launch with: {CPU_LAUNCH}")
            return value
    return 1


def launched_rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's number among those the launcher started (0 without a launcher), as accelerate will number it:
    what a run's set-up reads before its accelerator exists."""
    for name in RANK_VARIABLES:
        if env.get(name, "").isdigit():
            return int(env[name])
    return 0


def check_launch(env: Mapping[str, str] = os.environ) -> int:
    """The launch as the environment tells it, before anything is written or loaded: -> the number of
    processes launched. A UserError when the environment is malformed, or when `accelerate launch` was
    asked for several processes and started one."""
    launched = launched_processes(env)
    for name in ("RANK", "LOCAL_RANK"):
        text = env.get(name)
        if text is not None and not (text.isdigit() and (name == "LOCAL_RANK" or int(text) < launched)):
            raise UserError(f"{name}={text!r} in the environment is not a process number below the {launched} launched; "
                            f"the launcher sets it: unset it for one process, or launch with: {CPU_LAUNCH}")
    use_cpu = env.get("ACCELERATE_USE_CPU")
    if use_cpu is not None and use_cpu.lower() not in _FLAG_VALUES:
        raise UserError(f"ACCELERATE_USE_CPU={use_cpu!r} in the environment is not true or false; on CPU launch with: {CPU_LAUNCH}")
    if launched == 1 and "MASTER_ADDR" in env and any(name in env for name in ACCELERATE_LAUNCH_VARIABLES):
        raise UserError(
            "accelerate launch was asked for several processes but started one (MASTER_ADDR is set, WORLD_SIZE is not): "
            f"without GPUs `accelerate launch --num_processes N` runs a single process; on CPU launch with: {CPU_LAUNCH}"
        )
    return launched


def check_world_size(seen: int, env: Mapping[str, str] = os.environ) -> None:
    """The processes the trainer sees (`seen`, accelerate's num_processes) are those the launcher started:
    processes that do not see each other would each train alone and write the same run folder."""
    launched = check_launch(env)
    if launched > 1 and seen != launched:
        variable = next(name for name in WORLD_SIZE_VARIABLES if name in env)
        raise UserError(
            f"launched as {launched} processes ({variable}) but accelerate sees {seen}; "
            f"on CPU set ACCELERATE_USE_CPU=true: {CPU_LAUNCH}"
        )


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
