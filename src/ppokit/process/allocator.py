"""glibc's malloc told to give freed tensors back to the OS (docs/speed.md, "Memory the allocator keeps"); opt-in.

On CPU, torch takes a tensor's memory from the C library's `malloc`. glibc's serves a block of at least its mmap
threshold with a mapping of its own, unmapped when freed; a smaller one from its heaps, which keep freed memory for
reuse and hand back only what sits at their top. The threshold starts at 128 KiB and, each time a mapped block is
freed, rises to that block's size (up to 32 MiB), so after the first update the activations (1-4 MB blocks on the
variable-shape benchmark) come from the heaps, and their changing sizes leave holes later ones do not fill: that
benchmark's process held ~270-330 MB above what was in use (peak RSS 1.28-1.34 GB; 1.01 GB with the threshold fixed).

`settle` fixes the threshold (glibc's `mallopt(M_MMAP_THRESHOLD)`; a threshold set is never raised): blocks of at
least `MMAP_THRESHOLD` are mapped, and unmapped when freed. The price is a page fault for every page of every such
block, each time: 7-13 million more on that benchmark's two updates (docs/speed.md). So nothing calls it by default:
`benchmarks/ppo_throughput.py --switches allocator` measures it, and a caller who wants the memory back calls it (or
sets `MALLOC_MMAP_THRESHOLD_` before starting Python). Never over the user's choice (`MALLOC_MMAP_THRESHOLD_`, or
`GLIBC_TUNABLES` naming `glibc.malloc.mmap_threshold`); only glibc (elsewhere nothing happens). Standard library only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Callable, Mapping, Optional

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD = 128 << 10  # bytes: glibc's starting threshold, kept from rising (docs/speed.md: 128 KiB to 4 MiB measured)
CHOSEN_BY_USER = ("MALLOC_MMAP_THRESHOLD_",)  # the environment glibc reads at start-up


def settle(environ: Mapping[str, str] = os.environ, mallopt: Optional[Callable[[int, int], int]] = None) -> dict[str, int]:
    """Fix glibc malloc's mmap threshold at `MMAP_THRESHOLD` unless the user chose one (`environ`).
    mallopt: glibc's (default: looked up in the C library; none outside glibc). -> what was set, {} if nothing."""
    if any(name in environ for name in CHOSEN_BY_USER) or "glibc.malloc.mmap_threshold" in environ.get("GLIBC_TUNABLES", ""):
        return {}
    mallopt = glibc_mallopt() if mallopt is None else mallopt
    if mallopt is None or mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:  # mallopt returns 1 on success
        return {}
    return {"M_MMAP_THRESHOLD": MMAP_THRESHOLD}


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (malloc.h), every field a size_t
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                       "uordblks", "fordblks", "keepcost")]


def heap_usage(mallinfo2: Optional[Callable[[], _MallInfo2]] = None) -> Optional[dict[str, float]]:
    """glibc malloc's own count of this process's memory (`mallinfo2`, glibc 2.33+), in MiB -> {"in_use": the blocks
    in use (on its heaps and mapped), "held": what it holds from the OS (its heaps' size and the mapped blocks)}, or
    None where the C library has no mallinfo2. held - in_use: the freed memory its heaps keep (the part of the RSS
    a fixed mmap threshold gives back). mallinfo2: a stand-in for glibc's (tests)."""
    mallinfo2 = glibc_function("mallinfo2", [], _MallInfo2) if mallinfo2 is None else mallinfo2
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return {"in_use": (info.uordblks + info.hblkhd) / 2**20, "held": (info.arena + info.hblkhd) / 2**20}


def glibc_mallopt() -> Optional[Callable[[int, int], int]]:
    """glibc's `mallopt`, or None where the C library is not glibc (musl has no mallopt to speak of; macOS, Windows)."""
    return glibc_function("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)


def glibc_function(name: str, argtypes: list, restype) -> Optional[Callable]:
    """The C library's function `name` with its ctypes signature, or None where the C library is not glibc or lacks it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc's own: musl and others lack it
        function = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, restype
    return function
