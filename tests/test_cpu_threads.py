"""CPU threads of the `ppokit` program (ppokit/process/cpu_threads.py): passive waiting and the cgroup quota, set before torch
is imported, never over what the user set. Their effect on speed is benchmarks/cpu_threads.py's to show."""

import json
import os
import subprocess
import sys

import pytest

from ppokit.process import cpu_threads


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_cgroup_v2_quota_is_the_tightest_of_the_process_group_and_its_ancestors(tmp_path):
    cgroup = tmp_path / "proc-self-cgroup"
    write(cgroup, "0::/jobs/run\n")
    root = tmp_path / "cgroup"
    write(root / "jobs" / "run" / "cpu.max", "max 100000\n")
    write(root / "jobs" / "cpu.max", "150000 100000\n")
    assert cpu_threads.cgroup_cpu_quota(cgroup, root) == 1.5
    write(root / "jobs" / "run" / "cpu.max", "50000 100000\n")
    assert cpu_threads.cgroup_cpu_quota(cgroup, root) == 0.5
    assert cpu_threads.usable_cpus(cgroup, root) == 1  # half a CPU's time: one thread
    write(root / "jobs" / "run" / "cpu.max", "max 100000\n")
    write(root / "jobs" / "cpu.max", "max 100000\n")
    assert cpu_threads.cgroup_cpu_quota(cgroup, root) is None
    assert cpu_threads.usable_cpus(cgroup, root) == cpu_threads.visible_cpus()


def test_a_container_sees_its_own_group_as_the_root(tmp_path):
    cgroup = tmp_path / "proc-self-cgroup"
    write(cgroup, "0::/\n")
    root = tmp_path / "cgroup"
    write(root / "cpu.max", "200000 100000\n")
    assert cpu_threads.cgroup_cpu_quota(cgroup, root) == 2.0
    write(cgroup, "0::/not/mounted/here\n")  # a path of the host's hierarchy: the mount's own files apply
    assert cpu_threads.cgroup_cpu_quota(cgroup, root) == 2.0


def test_a_cgroup_v1_cfs_quota(tmp_path):
    cgroup = tmp_path / "proc-self-cgroup"
    write(cgroup, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n")
    root = tmp_path / "cgroup"
    write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "250000\n")
    write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    assert cpu_threads.cgroup_cpu_quota(cgroup, root) == 2.5
    write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "-1\n")  # no quota
    assert cpu_threads.cgroup_cpu_quota(cgroup, root) is None
    assert cpu_threads.cgroup_cpu_quota(tmp_path / "missing", root) is None


@pytest.mark.parametrize("given, cpus, chosen", [
    ({}, 10**6, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ({}, 1, {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, 10**6, {}),
    ({"GOMP_SPINCOUNT": "10000"}, 10**6, {}),
    ({"KMP_BLOCKTIME": "1"}, 10**6, {}),
    ({"OMP_NUM_THREADS": "7"}, 1, {"OMP_WAIT_POLICY": "PASSIVE"}),
])
def test_settle_sets_only_what_the_user_has_not(given, cpus, chosen):
    if cpus == 1 and cpu_threads.visible_cpus() == 1:
        pytest.skip("one CPU visible: no quota can take threads away")
    environ = dict(given)
    assert cpu_threads.settle(environ, cpus=min(cpus, cpu_threads.visible_cpus())) == chosen
    assert environ == {**given, **chosen}


PROGRAM = """
import json, os, sys
from ppokit import cli
from ppokit.process import cpu_threads

if sys.argv[1] == "quota":
    cpu_threads.cgroup_cpu_quota = lambda *paths: 1.0  # a cgroup allowing one CPU's time

def command(args):
    import torch  # after the program's start, as every command imports it
    cli.result(json.dumps({"wait": os.environ.get("OMP_WAIT_POLICY"), "threads": torch.get_num_threads()}))  # a command's result
    return 0

cli._report = command
sys.argv = ["ppokit", "report", "run"]
sys.exit(cli.main())
"""


@pytest.mark.parametrize("case", ["quota", "user's threads", "no quota"])
def test_the_program_settles_threads_before_torch_is_imported(case):
    """The guess demo ran ~18x slower beside four busy processes (spinning OpenMP threads) where one thread ran ~4x."""
    if cpu_threads.visible_cpus() == 1:
        pytest.skip("one CPU visible")
    env = {k: v for k, v in os.environ.items() if k not in cpu_threads.WAITING + ("OMP_NUM_THREADS",)}
    if case == "user's threads":
        env["OMP_NUM_THREADS"] = "2"
    result = subprocess.run([sys.executable, "-c", PROGRAM, "quota" if case != "no quota" else "-"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    if case == "no quota":  # torch's own count, as without ppokit
        threads = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env, capture_output=True,
                                     text=True, timeout=300, check=True).stdout)
    else:
        threads = {"quota": 1, "user's threads": 2}[case]
    assert seen == {"wait": "PASSIVE", "threads": threads}


def test_the_off_policy_benchmark_trains_with_the_programs_threads():
    """benchmarks/off_policy.py runs the trainer through the API, where nothing settles the threads: beside busy
    processes its synchronous updates (rollout.max_staleness 0) spent 4-50 s optimising the small model instead of 0.2 s."""
    env = {k: v for k, v in os.environ.items() if k not in cpu_threads.WAITING}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import os, sys; sys.path.insert(0, 'benchmarks'); import off_policy; "
            "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["PASSIVE", "False"]  # set, and before torch (its OpenMP runtime reads it when loaded)
