"""The launcher's environment: how many processes a launch asked for, checked against the processes the
trainer sees, before any model loads.

Launchers say it in the environment: torchrun (and accelerate's multi-process launcher, which is
torchrun) sets WORLD_SIZE, mpirun PMI_SIZE / OMPI_COMM_WORLD_SIZE / MV2_COMM_WORLD_SIZE. accelerate's
simple launcher - what `accelerate launch --num_processes N` runs without GPUs or `--multi_gpu` -
starts one process and sets MASTER_ADDR/MASTER_PORT for it (accelerate's commands/launch.py,
`prepare_simple_launcher_cmd_env`) but no world size: that one process would train alone, with the
batch of one and twice the updates, and say nothing.

Only the standard library: the command line checks the launch before importing anything heavy.
"""

from __future__ import annotations

import os
from typing import Mapping

from ppokit.errors import UserError

# In the order accelerate reads them (utils/environment.py, get_cpu_distributed_information).
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
# Set by every `accelerate launch` in the processes it starts (and by nothing else).
ACCELERATE_LAUNCH_VARIABLES = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND")
# What accelerate's str_to_bool accepts for ACCELERATE_USE_CPU.
_FLAG_VALUES = ("y", "yes", "t", "true", "on", "1", "n", "no", "f", "false", "off", "0")
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


def check_launch(env: Mapping[str, str] = os.environ) -> int:
    """The launch as the environment tells it, before anything is written or loaded: -> the number of
    processes launched. A UserError when the environment is malformed, or when `accelerate launch` was
    asked for several processes and started one."""
    launched = launched_processes(env)
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
