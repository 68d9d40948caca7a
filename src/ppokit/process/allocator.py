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
`GLIBC_TUNABLES` naming `glibc.malloc.mmap_threshold`); only glibc (elsewhere nothing happens).

`cpu_allocator: tcmalloc` replaces glibc's malloc with gperftools' (`preload_environment`: the environment the `ppokit`
program starts itself again with, the library first in `LD_PRELOAD`; `loaded`: whether it serves this process). It
reuses freed blocks of every size without the heaps' holes and without a page fault per use: on the variable-shape
benchmark ~175 MB less peak RSS at no cost in speed, and under 1000 MiB with `gradient_checkpointing` (docs/speed.md).
Standard library only (ppokit.errors, for the one-line error, is too).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Callable, Mapping, Optional

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD = 128 << 10  # bytes: glibc's starting threshold, kept from rising (docs/speed.md: 128 KiB to 4 MiB measured)
CHOSEN_BY_USER = ("MALLOC_MMAP_THRESHOLD_",)  # the environment glibc reads at start-up
TCMALLOC_COUNTS = ("generic.current_allocated_bytes", "generic.heap_size", "tcmalloc.pageheap_unmapped_bytes")
# cpu_allocator: the malloc libraries preloaded (gperftools' tcmalloc: the minimal build, else the full one), as
# ctypes.util.find_library names them, and where a user gets them.
PRELOADS = {"tcmalloc": ("tcmalloc_minimal", "tcmalloc")}
INSTALL = {"tcmalloc": "Debian/Ubuntu: apt-get install libtcmalloc-minimal4; Fedora: dnf install gperftools-libs; conda: conda install gperftools"}


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


def heap_usage(mallinfo2: Optional[Callable[[], _MallInfo2]] = None,
               tcmalloc_property: Optional[Callable[[str], Optional[int]]] = None) -> Optional[dict[str, float]]:
    """The malloc's own count of this process's memory, in MiB -> {"in_use": the blocks in use, "held": what it holds
    from the OS}, or None where it cannot be read. Under tcmalloc (`cpu_allocator`), its counters: in use
    `generic.current_allocated_bytes`, held `generic.heap_size` less `tcmalloc.pageheap_unmapped_bytes`. Else glibc's
    `mallinfo2` (glibc 2.33+): in use the blocks on its heaps and mapped, held its heaps' size and the mapped blocks;
    held - in_use is the freed memory its heaps keep (the part of the RSS a fixed mmap threshold gives back).
    mallinfo2, tcmalloc_property: stand-ins for the libraries' (tests; tcmalloc_property(name) -> bytes or None)."""
    tcmalloc_property = tcmalloc_numeric_property() if tcmalloc_property is None else tcmalloc_property
    if tcmalloc_property is not None:
        counts = [tcmalloc_property(name) for name in TCMALLOC_COUNTS]
        if None not in counts:
            in_use, heap, unmapped = counts
            return {"in_use": in_use / 2**20, "held": (heap - unmapped) / 2**20}
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


def tcmalloc_numeric_property() -> Optional[Callable[[str], Optional[int]]]:
    """tcmalloc's `MallocExtension_GetNumericProperty` as name -> bytes (None for a property it does not know), or None
    where tcmalloc is not this process's malloc."""
    try:
        function = ctypes.CDLL(None).MallocExtension_GetNumericProperty  # the preloaded library's, in the global scope
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int

    def read(name: str) -> Optional[int]:
        value = ctypes.c_size_t()
        return value.value if function(name.encode(), ctypes.byref(value)) else None
    return read


def loaded(name: str, maps: str = "/proc/self/maps") -> bool:
    """Whether `name`'s library (`PRELOADS`) is mapped into this process (Linux's `maps`; elsewhere: False)."""
    try:
        with open(maps) as f:
            files = {line.rsplit("/", 1)[-1].strip() for line in f if "/" in line}
    except OSError:
        return False
    return any(file.startswith(f"lib{library}.so") for library in PRELOADS[name] for file in files)


def preload_environment(name: str, environ: Mapping[str, str] = os.environ, find: Callable[[str], Optional[str]] = ctypes.util.find_library,
                        is_loaded: Optional[Callable[[str], bool]] = None) -> Optional[dict[str, str]]:
    """`cpu_allocator: name`: the environment to start this program again with, `name`'s library first in `LD_PRELOAD`
    (the dynamic linker loads it before the C library, and its malloc serves the whole process, torch's tensors
    included), or None where the process already runs with it. A UserError (one line: what to install) where the
    library is not found, or where LD_PRELOAD already named it and it still is not loaded (so a new start cannot help).
    environ: this process's environment; find: ctypes.util.find_library (tests: a stand-in); is_loaded: `loaded`."""
    from ppokit.errors import UserError

    if (loaded if is_loaded is None else is_loaded)(name):
        return None
    library = next(filter(None, (find(library) for library in PRELOADS[name])), None)
    if library is None:
        raise UserError(f"cpu_allocator: {name}: its library (lib{PRELOADS[name][0]}.so) is not installed ({INSTALL[name]}), or set cpu_allocator: null")
    preloaded = environ.get("LD_PRELOAD", "").replace(":", " ").split()
    if library in preloaded:
        raise UserError(f"cpu_allocator: {name}: LD_PRELOAD names {library} but the process did not load it (a Linux dynamic linker is needed); "
                        "set cpu_allocator: null")
    return {**environ, "LD_PRELOAD": " ".join([library, *preloaded])}
