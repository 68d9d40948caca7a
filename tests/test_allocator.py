"""The C allocator setting (ppokit/process/allocator.py): glibc's mmap threshold fixed, so that a freed large block goes back
to the OS, never over what the user set. Its effect on peak memory and page faults is docs/speed.md's to show."""

import ctypes.util
import json
import os
import subprocess
import sys

import pytest
import yaml

from ppokit.config.schema import PPOConfig
from ppokit.errors import UserError
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
    assert allocator.heap_usage(lambda: info, tcmalloc_property=lambda name: None) == {"in_use": 48.0, "held": 72.0}


def test_heap_usage_reads_tcmalloc_counters_under_tcmalloc():
    """in_use: tcmalloc's bytes allocated; held: its heap less what it has unmapped (MiB); glibc's count is not read."""
    counts = {"generic.current_allocated_bytes": 40 << 20, "generic.heap_size": 96 << 20, "tcmalloc.pageheap_unmapped_bytes": 16 << 20}
    unread = lambda: pytest.fail("mallinfo2 read under tcmalloc")  # noqa: E731
    assert allocator.heap_usage(unread, tcmalloc_property=counts.get) == {"in_use": 40.0, "held": 80.0}


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


TCMALLOC = next(filter(None, map(ctypes.util.find_library, allocator.PRELOADS["tcmalloc"])), None)


def test_preload_environment_puts_the_library_first_in_ld_preload():
    find = {"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}.get
    environ = {"LD_PRELOAD": "libother.so", "KEEP": "1"}
    assert allocator.preload_environment("tcmalloc", environ, find, is_loaded=lambda name: False) == {
        "LD_PRELOAD": "libtcmalloc_minimal.so.4 libother.so", "KEEP": "1"}
    assert allocator.preload_environment("tcmalloc", {}, {"tcmalloc": "libtcmalloc.so.4"}.get, lambda name: False) == {"LD_PRELOAD": "libtcmalloc.so.4"}
    assert allocator.preload_environment("tcmalloc", environ, find, is_loaded=lambda name: True) is None  # running with it: no new start


def test_preload_environment_says_in_one_line_what_to_install():
    with pytest.raises(UserError, match=r"^cpu_allocator: tcmalloc: its library \(libtcmalloc_minimal.so\) is not installed \(Debian/Ubuntu: apt-get "
                                        r"install libtcmalloc-minimal4;.*set cpu_allocator: null$"):
        allocator.preload_environment("tcmalloc", {}, lambda name: None, lambda name: False)
    # named already but not loaded (no dynamic linker that reads LD_PRELOAD): starting again would loop
    with pytest.raises(UserError, match="LD_PRELOAD names libtcmalloc_minimal.so.4 but the process did not load it"):
        allocator.preload_environment("tcmalloc", {"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, lambda name: "libtcmalloc_minimal.so.4", lambda name: False)


def test_loaded_reads_the_mapped_files(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10\n7f02-7f03 rw-p 0 0 0 [heap]\n")
    assert allocator.loaded("tcmalloc", str(maps))
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert not allocator.loaded("tcmalloc", str(maps)) and not allocator.loaded("tcmalloc", str(tmp_path / "absent"))


def test_a_bad_cpu_allocator_is_named():
    with pytest.raises(UserError, match="cpu_allocator"):
        PPOConfig.load(None, ["model=m", "cpu_allocator=jemalloc"])


def test_the_program_starts_itself_again_with_the_library(monkeypatch, tmp_path):
    """In the program (not in-process) a cpu_allocator it does not run with: exec of the same command line, the
    library in LD_PRELOAD, the real stdout back on descriptor 1; the check before any weights load refuses a process without it."""
    from ppokit import cli

    started = []

    class Started(Exception):
        pass

    def execve(path, argv, environ):
        started.append((path, argv, environ["LD_PRELOAD"]))
        raise Started

    monkeypatch.setattr(cli.os, "execve", execve)
    monkeypatch.setattr(allocator, "preload_environment", lambda name: {"LD_PRELOAD": f"lib{name}.so"})
    monkeypatch.setattr(cli, "_program", True)
    with pytest.raises(Started):
        cli._start_again_with("tcmalloc")
    assert started == [(sys.executable, sys.orig_argv, "libtcmalloc.so")]
    cli._start_again_with(None)
    monkeypatch.setattr(cli, "_program", False)  # called in-process: never replaces the caller's process
    cli._start_again_with("tcmalloc")
    assert len(started) == 1
    from ppokit.process.machine import check_machine

    monkeypatch.setattr(allocator, "loaded", lambda name: False)
    with pytest.raises(UserError, match="cpu_allocator: tcmalloc: this process runs without it"):
        check_machine(lora=False, quantization=None, fp16=False, compile=False, strategy="ddp", report_to=[], cpu_allocator="tcmalloc")


@pytest.mark.skipif(TCMALLOC is None, reason="gperftools' tcmalloc is not installed (apt-get install libtcmalloc-minimal4)")
def test_ppokit_ppo_runs_with_tcmalloc(model_dir, prompts_file, tmp_path):
    """End to end: `ppokit ppo` with cpu_allocator: tcmalloc trains (its start-up check passes only with the library
    mapped) and prints its result line on stdout."""
    config = {"model": str(model_dir("llama")), "output_dir": str(tmp_path / "run"), "reward": {"functions": ["sentiment"]},
              "data": {"train": str(prompts_file)}, "cpu_allocator": "tcmalloc",
              "ppo": {"total_episodes": 8, "per_device_train_batch_size": 4, "num_mini_batches": 2, "num_ppo_epochs": 1, "response_length": 4}}
    (tmp_path / "ppo.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    result = subprocess.run([sys.executable, "-m", "ppokit", "ppo", str(tmp_path / "ppo.yaml")], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["updates"] == 1
