import json
import os
import socket
import subprocess
import sys
import threading
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from ppokit.config import RemoteRewardConfig, RewardConfig
from ppokit.errors import UserError
from ppokit.rewards import RemoteReward, RewardError, RewardModelReward, ScoringBatch, build_scorer, function_source, make_server

BATCH = ScoringBatch(["q1", "q2", "q3"], ["a great film", "dull", "great fun"], {"answer": ["1", "2", "3"]})


@contextmanager
def running(server):
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_remote_scores_equal_local_scores_end_to_end():
    local = function_source({"function": "contains", "required": ["great"]}, "k")
    with running(make_server(local, port=0)) as url:
        remote = RemoteReward(url, batch_size=2, max_retries=0)
        assert torch.equal(remote.score(BATCH), local.score(BATCH))
        health = json.loads(urllib.request.urlopen(url, timeout=5).read())
        assert health == {"status": "ok", "source": "contains"}


def test_remote_reward_model_with_its_own_tokenizer(tokenizer, demo_data):
    from test_rewards_model import tiny_rm

    from ppokit.tiny import bpe_tokenizer

    rm_tok = bpe_tokenizer(r["prompt"] + " " + r["completion"] for r in demo_data["sft"])
    local = RewardModelReward(tiny_rm(rm_tok, seed=3), rm_tok)
    with running(make_server(local, port=0)) as url:
        got = RemoteReward(url, max_retries=0).score(BATCH)
    assert torch.allclose(got, local.score(BATCH), atol=1e-6)


class Flaky(BaseHTTPRequestHandler):
    """Fails the first `failures` requests with `status`, then answers with `reply`."""

    calls = 0
    failures, status, reply, headers_seen = 2, 503, None, []

    def do_POST(self):
        type(self).calls += 1
        type(self).headers_seen.append(self.headers.get("Authorization"))
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if type(self).calls <= self.failures:
            data, status = json.dumps({"error": "busy"}).encode(), self.status
        else:
            reply = self.reply if self.reply is not None else {"rewards": [float(len(c)) for c in body["completions"]]}
            data, status = json.dumps(reply).encode(), 200
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def flaky(**attrs):
    handler = type("Handler", (Flaky,), {"calls": 0, "headers_seen": [], **attrs})
    return handler, ThreadingHTTPServer(("127.0.0.1", 0), handler)


def test_retries_with_backoff_then_succeeds_and_expands_header_variables(monkeypatch):
    monkeypatch.setenv("PPOKIT_TEST_TOKEN", "s3cret")
    handler, server = flaky(failures=2, status=503)
    with running(server) as url:
        remote = RemoteReward(url, max_retries=2, backoff_s=0.01, headers={"Authorization": "Bearer ${PPOKIT_TEST_TOKEN}"})
        assert remote.score(BATCH).tolist() == [12.0, 4.0, 9.0]
    assert handler.calls == 3 and handler.headers_seen[-1] == "Bearer s3cret"


def test_gives_up_after_the_last_retry_with_a_clear_error():
    handler, server = flaky(failures=10, status=500)
    with running(server) as url:
        with pytest.raises(UserError, match=r"failed 3 time\(s\).*max_retries=2.*HTTP 500: busy"):
            RemoteReward(url, max_retries=2, backoff_s=0.01).score(BATCH)
    assert handler.calls == 3
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UserError, match=r"failed 2 time\(s\).*URLError"):
        RemoteReward(f"http://127.0.0.1:{port}/", max_retries=1, backoff_s=0.01, timeout_s=2).score(BATCH)


@pytest.mark.parametrize(
    "reply, message",
    [({"rewards": [1.0]}, "returned 1 scores for 3 completions"), ({"scores": [1, 2, 3]}, "expected"), ({"rewards": [1, None, 2]}, "nan for row 1")],
)
def test_bad_answers_are_never_read_as_zero(reply, message):
    _, server = flaky(failures=0, reply=reply)
    with running(server) as url:
        scorer = build_scorer(RewardConfig(remote=RemoteRewardConfig(url=url, max_retries=0)))
        with pytest.raises(RewardError, match=message):
            scorer.score(BATCH)


def test_client_errors_are_not_retried():
    handler, server = flaky(failures=10, status=401)
    with running(server) as url:
        with pytest.raises(UserError, match="HTTP 401"):
            RemoteReward(url, max_retries=3, backoff_s=0.01).score(BATCH)
    assert handler.calls == 1


def test_server_refuses_bad_and_oversized_requests_and_reports_source_failures():
    def boom(prompts, completions, **columns):
        if "dull" in completions:
            raise ValueError("dull is unscoreable")
        return [1.0] * len(completions)

    from ppokit.rewards import FunctionReward

    with running(make_server(FunctionReward(boom, "boom"), port=0, max_request_bytes=2000, max_rows=10)) as url:

        def post(body: bytes):
            try:
                with urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=5) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        assert post(b"{not json")[0] == 400
        assert post(json.dumps({"prompts": ["a"], "completions": ["b", "c"]}).encode())[0] == 400
        assert post(json.dumps({"prompts": ["a"] * 11, "completions": ["b"] * 11}).encode())[0] == 400
        assert post(json.dumps({"prompts": ["a" * 3000], "completions": ["b"]}).encode())[0] == 413
        assert post(json.dumps({"prompts": ["a"], "completions": ["b"]}).encode()) == (200, {"rewards": [1.0]})
        status, body = post(json.dumps({"prompts": ["a"], "completions": ["dull"]}).encode())
        assert status == 422 and "dull is unscoreable" in body["error"]
        # the client isolates the failing row when skipping
        scorer = build_scorer(RewardConfig(remote=RemoteRewardConfig(url=url, max_retries=0), on_error="skip"))
        with pytest.warns(UserWarning, match="dull is unscoreable"):
            result = scorer.score(BATCH)
        assert result.valid.tolist() == [True, False, True]


def test_serve_rm_command_serves_a_builtin_over_loopback(tmp_path):
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ppokit", "serve-rm", "{function: contains, required: [great]}", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )
    try:
        line = proc.stdout.readline()
        assert "serving reward source contains at http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" at ")[1].strip()
        assert RemoteReward(url, max_retries=0).score(BATCH).tolist() == [1.0, 0.0, 1.0]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_serve_rm_with_a_bad_source_is_one_line_and_exit_2(capsys):
    from ppokit.cli import main

    assert main(["serve-rm", "no_such_reward", "--port", "0"]) == 2
    assert "expected a built-in" in capsys.readouterr().err
