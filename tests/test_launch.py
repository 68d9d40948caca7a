"""The launcher's environment read before anything loads (ppokit.process.launcher); the real `accelerate launch`
is in tests/test_multiprocess.py."""

import pytest

from ppokit.errors import UserError
from ppokit.process.launcher import RANK_VARIABLES, check_launch, check_world_size, launched_processes, launched_rank

# What `accelerate launch` puts in a child's environment besides the user's (accelerate's utils/launch.py).
ACCELERATE = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_USE_CPU": "False"}


@pytest.mark.parametrize("env, processes", [
    ({}, 1),
    ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, 1),  # exported by a cluster, no launcher: one process
    (ACCELERATE, 1),  # accelerate launch of one process
    ({**ACCELERATE, "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", "RANK": "0"}, 2),  # accelerate launch --multi_gpu (torchrun)
    ({"WORLD_SIZE": "4", "RANK": "3", "ACCELERATE_USE_CPU": "true"}, 4),  # torchrun
    ({"PMI_SIZE": "3"}, 3),  # mpirun
])
def test_a_launch_that_runs_as_asked_passes(env, processes):
    assert check_launch(env) == launched_processes(env) == processes
    check_world_size(processes, env)


@pytest.mark.parametrize("env", [
    {}, {"RANK": "3", "WORLD_SIZE": "4"}, {"PMI_RANK": "2", "PMI_SIZE": "3"}, {"OMPI_COMM_WORLD_RANK": "1"},
    {"MV2_COMM_WORLD_RANK": "1"}, {"RANK": "0", "PMI_RANK": "5"},
])
def test_the_process_number_read_before_the_accelerator_is_the_one_accelerate_gives(env, monkeypatch):
    """A run's set-up reads its process number before the accelerator exists (which process checks output_dir, shows
    progress): accelerate's own reading of the same environment agrees."""
    from accelerate.utils.environment import get_cpu_distributed_information

    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launched_rank() == get_cpu_distributed_information().rank


def test_accelerate_asked_for_several_processes_that_started_one_is_refused():
    """Without GPUs `accelerate launch --num_processes 2` runs its simple launcher: one process, with
    MASTER_ADDR/MASTER_PORT set for the processes it does not start, and no WORLD_SIZE."""
    env = {**ACCELERATE, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(UserError, match=r"accelerate launch was asked for several processes but started one .*"
                                         r"on CPU launch with: ACCELERATE_USE_CPU=true torchrun --nproc_per_node N -m ppokit ppo CONFIG$"):
        check_launch(env)
    with pytest.raises(UserError, match="started one"):
        check_world_size(1, env)


def test_processes_that_do_not_see_each_other_are_refused():
    with pytest.raises(UserError, match=r"^launched as 2 processes \(WORLD_SIZE\) but accelerate sees 1; on CPU set ACCELERATE_USE_CPU=true: "
                                        r"ACCELERATE_USE_CPU=true torchrun"):
        check_world_size(1, {"WORLD_SIZE": "2", "RANK": "1"})
    with pytest.raises(UserError, match=r"launched as 3 processes \(OMPI_COMM_WORLD_SIZE\) but accelerate sees 1"):
        check_world_size(1, {"OMPI_COMM_WORLD_SIZE": "3"})


@pytest.mark.parametrize("name, value", [("WORLD_SIZE", ""), ("WORLD_SIZE", "two"), ("WORLD_SIZE", "0"), ("PMI_SIZE", "-1"),
                                         ("ACCELERATE_USE_CPU", ""), ("ACCELERATE_USE_CPU", "cpu"),
                                         ("RANK", "one"), ("RANK", "1"), ("LOCAL_RANK", "-1")])
def test_a_malformed_launcher_environment_is_one_line_naming_the_variable(name, value):
    with pytest.raises(UserError, match=rf"^{name}={value!r} in the environment is not "):
        check_launch({name: value})
