"""CPU threads of the `ppokit` program, settled before torch is imported (docs/speed.md, "CPU threads").

Two things made small runs collapse on a busy CPU:

- **Waiting threads spin.** Between parallel regions OpenMP's worker threads busy-wait for the next one (libgomp:
  about 300,000 spins). Beside other work, a descheduled thread makes the others spin through their whole time
  slice: the guess demo beside four `yes` processes ran ~18x slower than alone, where one thread ran at the fair
  ~4x. `OMP_WAIT_POLICY=PASSIVE` (standard OpenMP, read by libgomp, LLVM's and Intel's runtimes) has them sleep
  instead.
- **A CPU quota is not the CPUs seen.** torch takes its thread count from the CPUs it sees (here: the affinity
  mask); a container's cgroup quota (`docker --cpus 2` on a 64-core host) does not hide the others, and every
  thread beyond the quota waits its turn. The threads are capped at the quota.

Only what the user has not set: `OMP_WAIT_POLICY`, `GOMP_SPINCOUNT` or `KMP_BLOCKTIME` set keep the waiting as
they say; `OMP_NUM_THREADS` set keeps the count (and `torch.set_num_threads` in the user's own code runs after).
Only the program (`ppokit ...`): a Python caller of the API owns its process. Only the standard library.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import MutableMapping, Optional

WAITING = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # what says how OpenMP's idle threads wait


def settle(environ: MutableMapping[str, str] = os.environ, cpus: Optional[int] = None) -> dict[str, str]:
    """Set, in `environ` (before torch is imported: the runtimes read it when loaded), what the user has not:
    passive waiting, and the thread count where a cgroup quota allows fewer CPUs than the process sees. `cpus`:
    the usable CPUs (default `usable_cpus()`). -> what was set."""
    chosen = {}
    if not any(name in environ for name in WAITING):
        chosen["OMP_WAIT_POLICY"] = "PASSIVE"
    if "OMP_NUM_THREADS" not in environ:
        usable = usable_cpus() if cpus is None else cpus
        if usable < visible_cpus():
            chosen["OMP_NUM_THREADS"] = str(usable)
    environ.update(chosen)
    return chosen


def visible_cpus() -> int:
    """CPUs this process may be scheduled on: its affinity mask (what torch's default thread count follows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def usable_cpus(cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs' worth of time this process may use: the visible CPUs, at most the cgroup CPU quota rounded up."""
    quota = cgroup_cpu_quota(cgroup, root)
    visible = visible_cpus()
    return visible if quota is None else max(1, min(visible, math.ceil(quota)))


def cgroup_cpu_quota(cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> Optional[float]:
    """The tightest CPU quota (quota / period, in CPUs) of this process's cgroup and its ancestors, or None: cgroup v2's
    `cpu.max` ("max 100000" or "150000 100000"), v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none). A container
    sees its own cgroup as `/`; a path not found under `root` is looked up from `root` itself."""
    try:
        lines = cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy for every controller
            limits += _quotas(root, path, lambda d: _v2(d / "cpu.max"))
        elif "cpu" in controllers.split(","):
            mount = next((root / name for name in (controllers, "cpu", "cpu,cpuacct") if (root / name).is_dir()), None)
            if mount is not None:
                limits += _quotas(mount, path, lambda d: _v1(d / "cpu.cfs_quota_us", d / "cpu.cfs_period_us"))
    return min(limits, default=None)


def _quotas(mount: Path, path: str, read) -> list[float]:
    """The quotas found in `path`'s folder under `mount` and every folder above it (or `mount` alone where the path is not there)."""
    folder = mount / path.strip("/")
    if not folder.is_dir():
        folder = mount
    found = []
    while True:
        quota = read(folder)
        if quota is not None:
            found.append(quota)
        if folder == mount:
            return found
        folder = folder.parent


def _v2(file: Path) -> Optional[float]:
    try:
        quota, period = file.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1(quota_file: Path, period_file: Path) -> Optional[float]:
    try:
        quota, period = int(quota_file.read_text()), int(period_file.read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None
