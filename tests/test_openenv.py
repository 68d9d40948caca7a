"""`ppokit.environments:OpenEnv` against the installed openenv-core: a small OpenEnv environment in its template style
(tests/envs/openenv_words.py) used in this process and served on loopback by openenv's own create_app + uvicorn, each
training through `ppokit ppo`; every episode's session closed once (and a server that logs nothing for it); bad input
in one line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from functools import partial
from pathlib import Path

import pytest
import word_game_runs
from word_game_runs import WAIT_BOUND_S, check_closed, check_trained, one_line_error, run_ppo

pytest.importorskip("openenv", reason="needs ppokit[openenv]")

WORDS = Path(__file__).parent / "envs" / "openenv_words.py"
SPEC = "ppokit.environments:OpenEnv"
rows, events, ppo = word_game_runs.rows, word_game_runs.events, partial(run_ppo, SPEC)  # the shared fixtures, and the run


def test_an_openenv_environment_in_process_trains_through_ppokit_ppo(sft_model_dir, rows, tmp_path, events, capsys):
    err = check_trained(ppo(sft_model_dir, rows, tmp_path, {"env": f"{WORDS}:WordsEnvironment"}), capsys, tmp_path / "run", events)
    assert "SUPPORTS_CONCURRENT_SESSIONS" not in err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if "reward/environment" in r]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path, events):
    """The words environment served by openenv's create_app in a subprocess on a loopback port; -> (url, its log)."""
    started = []

    def start(max_sessions: int = 64):
        port, log = free_port(), tmp_path / f"server-{len(started)}.log"
        with open(log, "w") as out:
            process = subprocess.Popen([sys.executable, str(WORDS), str(port), str(max_sessions)], stdout=out, stderr=subprocess.STDOUT,
                                       env=dict(os.environ))
        started.append(process)
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + WAIT_BOUND_S
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                return url, log
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the OpenEnv server did not start: {log.read_text()}")
                time.sleep(0.1)

    yield start
    for process in started:
        process.terminate()
        process.wait(30)


def test_an_openenv_server_trains_through_ppokit_ppo_and_logs_nothing(sft_model_dir, rows, tmp_path, events, server, capsys):
    url, log = server()
    # the server's instances: one per session, closed when ppokit ends the session
    check_trained(ppo(sft_model_dir, rows, tmp_path, {"base_url": url}), capsys, tmp_path / "run", events)
    assert log.read_text() == ""  # no disconnect traceback, no error: every session ended as the server expects


def test_a_server_that_refuses_concurrent_sessions_stops_the_run_in_one_line(sft_model_dir, rows, tmp_path, events, server, capsys):
    url, _ = server(max_sessions=1)
    line = one_line_error(ppo(sft_model_dir, rows, tmp_path, {"base_url": url}), capsys.readouterr().err)
    assert f"the OpenEnv server at {url} refused a session (" in line and "max_sessions 1" in line or "1/1 sessions" in line
    assert "set rollout.max_concurrent_episodes to that number" in line
    # with one episode at a time it runs, once the server has let go of the stopped run's session (it does so on its own
    # time after that client is gone: a run started at once may still find it held, as CI saw once)
    deadline, attempt = time.monotonic() + WAIT_BOUND_S, 0
    while True:
        attempt += 1
        code = ppo(sft_model_dir, rows, tmp_path, {"base_url": url}, "rollout.max_concurrent_episodes=1", f"output_dir={tmp_path / f'again-{attempt}'}")
        err = capsys.readouterr().err
        if code != 0 and "Server at capacity" in err and time.monotonic() < deadline:
            time.sleep(0.5)
            continue
        assert code == 0, err
        break


def test_a_class_that_does_not_declare_concurrent_sessions_is_said_at_the_start(sft_model_dir, rows, tmp_path, events, capsys):
    assert ppo(sft_model_dir, rows, tmp_path, {"env": f"{WORDS}:SharedWordsEnvironment"}, "rollout.max_concurrent_episodes=1") == 0
    err = capsys.readouterr().err
    assert ("SharedWordsEnvironment.SUPPORTS_CONCURRENT_SESSIONS is False (OpenEnv's default: its server would serve one "
            "session at a time); in this process each episode has its own instance") in err


@pytest.mark.parametrize("args, said", [
    ({"base_url": "http://127.0.0.1:{port}"}, "the OpenEnv server at http://127.0.0.1:{port} does not answer /health ("),
    ({"docker_image": "ppokit-test-image"}, "environment_args.docker_image 'ppokit-test-image' needs Docker, and `docker version` fails here"),
    ({}, "environment_args needs exactly one of env (FILE.py:Class), base_url or docker_image; got none of them"),
    ({"env": f"{WORDS}:WordsAction"}, "WordsAction is not an OpenEnv Environment class"),
    ({"env": f"{WORDS}:WordsEnvironment", "observation_field": "reply"}, "unexpected keyword argument 'observation_field'"),
], ids=["server_down", "docker_without_docker", "nothing_named", "not_an_environment", "unknown_key"])
def test_bad_input_is_one_line_at_the_start_and_leaves_no_run_folder(sft_model_dir, rows, tmp_path, events, args, said, monkeypatch, capsys):
    port = free_port()  # nothing listens there
    args = {key: value.format(port=port) for key, value in args.items()}
    monkeypatch.setenv("PATH", str(tmp_path / "no-docker-here"))  # `docker` is not found, as on a machine without Docker
    line = one_line_error(ppo(sft_model_dir, rows, tmp_path, args), capsys.readouterr().err)
    assert said.format(port=port) in line
    assert not (tmp_path / "run").exists()


def test_openenv_missing_names_the_extra(sft_model_dir, rows, tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "openenv" or m.startswith("openenv.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "openenv", None)
    line = one_line_error(ppo(sft_model_dir, rows, tmp_path, {"env": f"{WORDS}:WordsEnvironment"}), capsys.readouterr().err)
    assert line == f"ppokit: error: environment {SPEC}: the openenv-core package is not installed; pip install 'ppokit[openenv]'"
    assert not (tmp_path / "run").exists()


def test_an_action_function_that_raises_is_the_episodes_error(sft_model_dir, rows, tmp_path, events, capsys):
    args = {"env": f"{WORDS}:WordsEnvironment", "action": f"{WORDS}:raising_action"}
    line = one_line_error(ppo(sft_model_dir, rows, tmp_path, args), capsys.readouterr().err)
    assert line.startswith(f"ppokit: error: environment {SPEC}: step raised ValueError: environment_args.action {WORDS}:raising_action "
                           "raised ValueError: no words today; prompt ")
    check_closed(events)  # the failed episodes' instances closed too


def test_the_action_class_comes_from_the_generics_and_functions_replace_the_text_fields():
    from ppokit.environments import OpenEnv
    from ppokit.errors import UserError

    game = OpenEnv(env=f"{WORDS}:GenericWordsEnvironment")  # step unannotated: Environment[WordsAction, ...]
    assert game.reset({"prompt": "p", "seed": 2}) is None  # reset's reply is "": no observation
    assert game.step("one") == ("bad", 0.1, False) and game.step("one two") == ("good", 1.0, True)
    game.close()
    shaped = OpenEnv(env=f"{WORDS}:WordsEnvironment", action=f"{WORDS}:words_action", observation=f"{WORDS}:words_text")
    shaped.reset({"seed": 3})
    assert shaped.step("a b") == ("bad 2", 0.2, False)
    with pytest.raises(UserError, match="cannot tell UntypedWordsEnvironment's action type: annotate step"):
        OpenEnv(env=f"{WORDS}:UntypedWordsEnvironment")


def test_a_refusal_read_after_the_server_closed_the_socket_is_still_the_capacity_line(server, events):
    """A server at capacity sends its refusal and closes the socket at once; a client that sends its reset after the
    close fails to send (ConnectionClosed) with the refusal unread: the line is the same as when it reads it first."""
    import asyncio

    from openenv.core.generic_client import GenericEnvClient

    from ppokit.environments import OpenEnv
    from ppokit.errors import UserError

    url, _ = server(max_sessions=1)

    async def refused():
        holder = OpenEnv(base_url=url)
        await holder.reset({"seed": 1})  # the server's one session
        late = OpenEnv(base_url=url)
        late._env = GenericEnvClient(base_url=url)
        await late._env.connect()
        await asyncio.wait_for(late._env._ws.wait_closed(), WAIT_BOUND_S)  # refused and closed before anything is sent
        try:
            with pytest.raises(UserError, match=r"refused a session \(Server at capacity: 1/1 sessions active.*max_sessions 1\)"):
                await late._remote(late._env.reset())
        finally:
            await late.close()
            await holder.close()

    asyncio.run(refused())
