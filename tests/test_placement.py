"""Where the vLLM engine runs (`rollout.placement`): the keys' rules and the one line a lost engine ends a run with.
No vLLM needed; the placements themselves run in tests/test_engine_vllm_servers.py."""

import contextlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
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


# A stand-in for vLLM's API server, launched by the same code (`LaunchedServer.of_command`): it starts an "engine" that
# starts a "worker" (as the API server starts the engine core, which starts its workers), writes their pids into its
# folder, and then serves GET /health on its port. The worker's way with SIGTERM: meek (ends), slow (ends a second
# later: vLLM's engine core outlives the API server's own exit by a moment), stubborn (ignores it).
WORKER = """
import signal, sys, time
if sys.argv[1] == "slow":
    signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1), sys.exit(0)))
elif sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("up", flush=True)
time.sleep(600)
"""
ENGINE = f"""
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", {WORKER!r}, sys.argv[1]], stdout=subprocess.PIPE)
assert worker.stdout.readline() == b"up\\n"
print(worker.pid, flush=True)
time.sleep(600)
"""
STAND_IN = f"""
import http.server, json, os, subprocess, sys
port, worker_mode, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
engine = subprocess.Popen([sys.executable, "-c", {ENGINE!r}, worker_mode], stdout=subprocess.PIPE)
worker = int(engine.stdout.readline())
with open(os.path.join(folder, "pids.json"), "w") as f:
    json.dump({{"server": os.getpid(), "engine": engine.pid, "worker": worker}}, f)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def launch_stand_in(worker_mode: str, timeout_s: float = 120):
    """A stand-in server (above) launched as ppokit launches vLLM's -> (the LaunchedServer, {role: pid})."""
    import tempfile

    from ppokit.engines.launched_server import LaunchedServer, free_port

    folder, port = Path(tempfile.mkdtemp(prefix="ppokit-vllm-stand-in-")), free_port()
    server = LaunchedServer.of_command([sys.executable, "-c", STAND_IN, str(port), worker_mode, str(folder)], folder, port,
                                       dict(os.environ), timeout_s)
    return server, json.loads((folder / "pids.json").read_text())


def gone(pid: int) -> bool:
    from ppokit.engines.server_guard import process_start

    return process_start(pid) is None


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes and their groups from /proc")


@needs_proc
def test_stopping_a_launched_server_waits_for_every_process_of_its_group():
    """vLLM's server exits at SIGTERM before the engine core it started does: `stop` returns only when no process of
    the group is left (a run that ends leaves no server process behind), and removes its folder."""
    from ppokit.engines.server_guard import live_in_group

    server, pids = launch_stand_in("slow")
    try:
        assert server.died() is None and live_in_group(server.process.pid)
        server.stop()
        assert not live_in_group(server.process.pid) and all(gone(pid) for pid in pids.values())
        assert not server.folder.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)


TRAINER = f"""
import json, os, sys, time
sys.path[:0] = [{str(Path(__file__).parent)!r}]
from test_placement import launch_stand_in
server, pids = launch_stand_in("stubborn")
print(json.dumps({{"group": server.process.pid, "folder": str(server.folder), "pids": pids}}), flush=True)
time.sleep(600)
"""


@needs_proc
def test_a_server_ends_with_its_trainer_when_the_trainer_is_sigkilled(tmp_path):
    """A trainer-like process launches a server (the launch code of `rollout.placement: separate`, on the stand-in whose
    worker ignores SIGTERM) and is SIGKILLed: no process of the server's tree is left, and its folder is gone, within
    the guard's SIGTERM grace and a generous margin (on a quiet machine: the grace, about 10 s)."""
    from ppokit.engines.server_guard import GRACE_S, group_processes

    trainer = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE, stderr=open(tmp_path / "stderr", "wb"))
    group = folder = None
    try:
        said = json.loads(trainer.stdout.readline() or "null")
        assert said is not None, (tmp_path / "stderr").read_text()[-2000:]
        group, folder, pids = said["group"], Path(said["folder"]), said["pids"]
        assert set(group_processes(group)) >= {group, *pids.values()} and folder.is_dir()
        trainer.kill()
        trainer.wait(30)
        deadline = time.monotonic() + GRACE_S + 60
        while (group_processes(group) or folder.exists()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not group_processes(group), group_processes(group)
        assert all(gone(pid) for pid in pids.values())
        assert not folder.exists()
    finally:
        trainer.kill()
        if group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


@needs_proc
def test_a_server_whose_engine_is_killed_is_noticed_within_seconds():
    """SIGKILL of the engine (vLLM: the engine core) leaves the API server up and silent: a wait for requests notices
    within seconds, with one line naming the server and the process, not at the wait's deadline (rollout.server_timeout_s:
    60 s here).
    While the whole tree runs, the same wait only times out."""
    import queue

    from ppokit.engines.vllm_servers import WATCH_S, next_done

    server, pids = launch_stand_in("meek")
    try:
        started = time.monotonic()
        assert next_done(queue.Queue(), time.monotonic() + 2 * WATCH_S, [server]) is None  # up: nothing to say
        assert time.monotonic() - started >= 2 * WATCH_S
        os.kill(pids["engine"], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineLost) as lost:
            next_done(queue.Queue(), time.monotonic() + 60, [server])
        took = time.monotonic() - started
        said = str(lost.value)
        assert said.startswith(f"rollout server {server.address} stopped serving: its process {pids['engine']} (python") and "\n" not in said, said
        assert took < 30, took  # about WATCH_S on a quiet machine
    finally:
        server.stop()  # keeps the folder of a server that died (its output says why): the test's to remove
        shutil.rmtree(server.folder, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- HTTP to rollout servers


class StandIn(http.server.BaseHTTPRequestHandler):
    """A rollout server's routes as the engine's HTTP calls meet them: JSON, 404, an error, an answer trickled."""

    def answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            return self.answer(200, b"")
        if self.path == "/get_world_size":
            return self.answer(200, b'{"world_size": 2}')
        if self.path == "/broken":
            return self.answer(500, b'{"error": {"message": "the engine is asleep"}}')
        self.answer(404, b'{"detail": "Not Found"}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("trickle"):  # a byte every 0.3 s for 12 s: each read is quick, the whole is not
            self.send_response(200)
            self.send_header("Content-Length", "40")
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(40):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.3)
            return
        self.answer(200, json.dumps({"choices": [{"token_ids": body["token_ids"][::-1]}]}).encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in():
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_rollout_servers_answers_and_failures_over_http(stand_in):
    """The control plane's blocking calls and the token route's awaitable ones: the answer, or one line naming the
    server and what went wrong; a request has rollout.server_timeout_s in all, however slowly the answer comes."""
    import asyncio

    from ppokit.engines.launched_server import free_port
    from ppokit.engines.vllm_servers import Server, http_client

    server = Server(stand_in, timeout_s=1.5)
    assert server.call("GET", "/health") is None and server.call("GET", "/get_world_size") == {"world_size": 2}
    with pytest.raises(EngineLost, match=rf"rollout server {stand_in} has no /pause route: start it with VLLM_SERVER_DEV_MODE=1"):
        server.call("GET", "/pause")
    with pytest.raises(EngineLost, match=rf"rollout server {stand_in} refused /broken \(HTTP 500\): the engine is asleep$"):
        server.call("GET", "/broken")
    gone = Server(f"127.0.0.1:{free_port()}", timeout_s=1.5)
    with pytest.raises(EngineLost, match=r"cannot be reached \(/health\): connection refused$"):
        gone.call("GET", "/health")

    async def generate(server: Server, body: dict):
        async with http_client(httpx.AsyncClient, server.timeout_s) as client:
            return await server.generate(client, body)

    assert asyncio.run(generate(server, {"token_ids": [1, 2, 3]})) == {"choices": [{"token_ids": [3, 2, 1]}]}
    with pytest.raises(EngineLost, match=r"was lost during a request: connection refused$"):
        asyncio.run(generate(gone, {"token_ids": [1]}))
    started = time.monotonic()
    with pytest.raises(EngineLost, match=rf"rollout server {stand_in} did not complete a request within 1.5 s"):
        asyncio.run(generate(server, {"trickle": True}))
    assert time.monotonic() - started < 8  # 1.5 s, not the 12 s the answer trickles for
@pytest.mark.parametrize("overrides, message", [
    (["rollout.lora_merge=false"], "rollout.lora_merge: false sends the engine a LoRA adapter, and this run trains all weights"),
    (["lora={}", "lora.r=513", "rollout.lora_merge=false"], "lora.r: 513 is over vLLM's largest max_lora_rank (512)"),
    (["lora={}", "lora.use_dora=true", "rollout.lora_merge=false"], "lora.use_dora with rollout.lora_merge: false: vLLM serves no DoRA adapter"),
    (["lora={}", "lora.use_dora=true"], "lora.use_dora with rollout.engine: vllm: a DoRA adapter cannot be merged"),
    (["lora={}", "quantization=4bit"], "quantization: 4bit with rollout.engine: vllm: a quantised base cannot be sent to the engine"),
    (["lora={}", "rollout.lora_merge=false", "rollout.placement=servers", "rollout.servers=[127.0.0.1:8000, node2:8000, 10.0.0.5:1]"],
     "rollout.lora_merge: false with rollout.servers on other machines (node2:8000, 10.0.0.5:1): a server reads the adapter"),
    (["lora={}", "rollout.lora_merge=false", "rollout.sleep=true"], "rollout.sleep with rollout.lora_merge: false: the engine sends its base weights once"),
])
def test_a_lora_policy_vllm_cannot_take_is_one_line_before_anything_is_written(tmp_path, capsys, overrides, message):
    """rollout.lora_merge: false (the adapter alone to vLLM) and the LoRA policies the engine cannot take, merged or not:
    refused when the config is read (ppokit ppo and ppokit plan), exit 2, one line, no run folder; vLLM not needed."""
    import yaml

    from ppokit.cli import main

    config = tmp_path / "ppo.yaml"
    config.write_text(yaml.safe_dump({"model": "some/model", "output_dir": str(tmp_path / "run"), "reward": {"functions": ["length"]},
                                      "data": {"train": str(tmp_path / "p.jsonl")}, "rollout": {"engine": "vllm"}}))
    for command in ("ppo", "plan"):
        assert main([command, str(config), *overrides]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith(f"ppokit: error: {message}") and captured.err.count("\n") == 1, captured.err
    assert not (tmp_path / "run").exists()
    load("lora={}", "rollout.lora_merge=false", "lora.r=512")  # the largest rank vLLM serves
    load("lora={}", "rollout.lora_merge=false", "lora.use_rslora=true")
    load("lora={}", "rollout.lora_merge=false", "rollout.placement=separate")  # its server runs on this machine
    load("lora={}", "rollout.lora_merge=false", "rollout.placement=servers", "rollout.servers=[127.0.0.1:8000, localhost:8001, '[::1]:8002']")
