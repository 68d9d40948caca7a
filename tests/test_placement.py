"""Where the vLLM engine runs (`rollout.placement`): the keys' rules and the one line a lost engine ends a run with.
No vLLM needed; the placements themselves run in tests/test_engine_vllm_servers.py."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ppokit.config.schema import PPOConfig
from ppokit.engines.base import EngineLost, engine_lost
from ppokit.errors import UserError

BASE = ["model=m", "reward.functions=[length]", "rollout.engine=vllm"]


def load(*overrides):
    return PPOConfig.load(None, [*BASE, *overrides]).validate()


def test_servers_are_listed_exactly_with_placement_servers():
    config = load("rollout.placement=servers", "rollout.servers=[10.0.0.5:8000, node2:8001]")
    assert config.rollout.servers == ["10.0.0.5:8000", "node2:8001"]
    with pytest.raises(UserError, match="rollout.placement: servers needs rollout.servers"):
        load("rollout.placement=servers")
    with pytest.raises(UserError, match="rollout.servers is for rollout.placement: servers, and this run's is separate"):
        load("rollout.placement=separate", "rollout.servers=[a:1]")
    for bad in ("[a]", "[a:port]", "[:80]", "[a:1, a:1]"):
        with pytest.raises(UserError, match="rollout.servers: value .* host:port"):
            load("rollout.placement=servers", f"rollout.servers={bad}")


def test_keys_that_would_not_be_read_are_refused():
    """A value the user set is never silently ignored: the build options of an engine ppokit does not build (servers), sleep
    where the engine shares no device with training, the server keys of an engine in the trainer's own process."""
    servers = ("rollout.placement=servers", "rollout.servers=[a:1]")
    for key in ("gpu_memory_utilization=0.5", "enforce_eager=false", "max_model_len=512", "sleep=true"):
        with pytest.raises(UserError, match=f"rollout.{key.split('=')[0]} .* is not read with rollout.placement: servers"):
            load(*servers, f"rollout.{key}")
    with pytest.raises(UserError, match="rollout.sleep .* is not read with rollout.placement: separate"):
        load("rollout.placement=separate", "rollout.sleep=true")
    load("rollout.placement=separate", "rollout.max_model_len=512", "rollout.gpu_memory_utilization=0.8")  # ppokit builds it
    for key in ("server_timeout_s=5", "weight_transfer=gloo"):
        with pytest.raises(UserError, match=f"rollout.{key.split('=')[0]} is for rollout.placement separate or servers"):
            load(f"rollout.{key}")
    with pytest.raises(UserError, match="rollout.placement .* is for rollout.engine: vllm"):
        PPOConfig.load(None, ["model=m", "reward.functions=[length]", "rollout.placement=separate"]).validate()
    with pytest.raises(UserError, match="rollout.weight_transfer: value 'ipc' is out of range"):
        load("rollout.placement=separate", "rollout.weight_transfer=ipc")
    with pytest.raises(UserError, match=r"rollout.server_timeout_s: value 0\.0 is out of range"):
        load("rollout.placement=separate", "rollout.server_timeout_s=0")


def test_a_lost_engine_is_one_line_naming_it_and_where_to_resume():
    lost = EngineLost("rollout server 10.0.0.5:8000 was lost during a request: connection refused")
    said = engine_lost(lost, Path("runs/x/checkpoint-3"))
    assert isinstance(said, UserError) and "\n" not in str(said)
    assert str(said).startswith("rollout server 10.0.0.5:8000 was lost") and "the last complete checkpoint is runs/x/checkpoint-3" in str(said)
    assert "no checkpoint of this run was written yet" in str(engine_lost(lost, None))
    assert engine_lost(RuntimeError("something else"), None) is None


CHILD = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1), sys.exit(0)))
print("ready", flush=True)
time.sleep(120)
"""
LEADER = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", {CHILD!r}])
time.sleep(120)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process group from /proc")
def test_stopping_a_launched_server_waits_for_every_process_of_its_group(tmp_path):
    """vLLM's server exits at SIGTERM before the engine core it started does: `stop` returns only when no process of
    the group is left (a run that ends leaves no server process behind), and keeps its folder only when asked."""
    from ppokit.engines import launched_server

    server = object.__new__(launched_server.LaunchedServer)
    server.folder = tmp_path / "server"
    server.folder.mkdir()
    server.process = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert server.process.stdout.readline() == b"ready\n"  # the child's SIGTERM handler is in place
        assert launched_server._live_in_group(server.process.pid)
        server.stop()
        assert not launched_server._live_in_group(server.process.pid)
        assert not server.folder.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)
