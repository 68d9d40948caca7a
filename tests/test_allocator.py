"""The C allocator setting (ppokit/process/allocator.py): glibc's mmap threshold fixed, so that a freed large block goes back
to the OS, never over what the user set. Its effect on peak memory and page faults is docs/speed.md's to show."""

import os
import subprocess
import sys

import pytest

from ppokit.process import allocator

GLIBC = allocator.glibc_mallopt() is not None
ENV = {k: v for k, v in os.environ.items() if k not in allocator.CHOSEN_BY_USER and k != "GLIBC_TUNABLES"}

# Whether a block of 8 MiB, malloc'ed after one of that size was freed, is mapped (glibc's mallinfo2: hblks, the mapped
# blocks, one more). glibc's own threshold rises to the freed block's size, so the second comes from the heap; a fixed one keeps it mapped.
SECOND_BLOCK_MAPPED = """
import ctypes
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                       "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype, libc.malloc.restype, libc.free.argtypes = Info, ctypes.c_void_p, [ctypes.c_void_p]
libc.malloc.argtypes = [ctypes.c_size_t]
def second_block_mapped():
    libc.free(libc.malloc(8 << 20))
    mapped = libc.mallinfo2().hblks  # the interpreter's own mapped blocks
    block = libc.malloc(8 << 20)
    mapped = libc.mallinfo2().hblks - mapped
    libc.free(block)
    return mapped == 1
"""


class Calls:
    def __init__(self, result=1):
        self.calls, self.result = [], result

    def __call__(self, option, value):
        self.calls.append((option, value))
        return self.result


@pytest.mark.parametrize("given, sets", [
    ({}, True),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, True),  # another tunable: the threshold is still ours to set
    ({"MALLOC_MMAP_THRESHOLD_": "65536"}, False),
    ({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.mmap_threshold=65536"}, False),
])
def test_settle_fixes_the_threshold_only_where_the_user_has_not(given, sets):
    mallopt = Calls()
    assert allocator.settle(given, mallopt) == ({"M_MMAP_THRESHOLD": allocator.MMAP_THRESHOLD} if sets else {})
    assert mallopt.calls == ([(allocator.M_MMAP_THRESHOLD, allocator.MMAP_THRESHOLD)] if sets else [])


def test_a_refused_mallopt_is_not_reported_as_set():
    assert allocator.settle({}, Calls(result=0)) == {}


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
@pytest.mark.parametrize("settled", [False, True])
def test_a_freed_large_block_is_given_back_after_settle(settled):
    """glibc's default keeps a second large block on its heap (the variable-shape benchmark held ~270 MB it did not use)."""
    code = SECOND_BLOCK_MAPPED + f"from ppokit.process import allocator\nif {settled}: assert allocator.settle()\nprint(second_block_mapped())"
    result = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(settled)]


def test_heap_usage_reads_blocks_in_use_and_what_is_held():
    """in_use: heap blocks in use + mapped blocks; held: the heaps' size + mapped blocks (MiB); None without mallinfo2."""
    info = allocator._MallInfo2(arena=64 << 20, hblkhd=8 << 20, uordblks=40 << 20, fordblks=24 << 20)
    assert allocator.heap_usage(lambda: info) == {"in_use": 48.0, "held": 72.0}


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_heap_usage_counts_a_block_while_it_is_allocated():
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    before = allocator.heap_usage()
    block = libc.malloc(64 << 20)
    during = allocator.heap_usage()
    libc.free(block)
    # in use grows by the block wherever glibc puts it; what it holds grows only when the block is mapped or the heap
    # grows (a heap with 64 MiB free already, as after other tests in the same process, serves it from there)
    assert during["in_use"] - before["in_use"] >= 64 and during["held"] >= during["in_use"]
