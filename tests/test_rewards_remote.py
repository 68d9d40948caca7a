import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import yaml

from ppokit.config.schema import RemoteRewardConfig, RewardConfig
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

    from ppokit.demos.tiny import bpe_tokenizer

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
    with pytest.raises(UserError, match=r"failed 2 time\(s\).*last error: ConnectError: .*Connection refused"):
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
        proc.terminate()  # SIGTERM: the server stops, then the signal ends the process as it would have (no traceback)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGTERM and "Traceback" not in err, (proc.returncode, err)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_serve_rm_with_a_bad_source_is_one_line_and_exit_2(capsys):
    from ppokit.cli import main

    assert main(["serve-rm", "no_such_reward", "--port", "0"]) == 2
    assert "expected a built-in" in capsys.readouterr().err


# --------------------------------------------------------------------------- addresses, redirects, credentials


@pytest.mark.parametrize(
    "url, message",
    [
        ("file:///etc/hostname", r"reward.remote.url: scheme file:// is not supported; use http:// or https://"),
        ("ftp://127.0.0.1/", r"scheme ftp:// is not supported"),
        ("rm-host:8000/score", r"'rm-host:8000/score' has no scheme; write http://rm-host:8000/score \(or https://\)"),
        ("127.0.0.1:8000", r"has no scheme; write http://127.0.0.1:8000"),
        ("http://user:pw@127.0.0.1/", r"user:password@ in the URL is not supported; put credentials in reward.remote.headers"),
        ("http://127.0.0.1:99999/", r"is not a valid URL \(Port out of range"),
        ("http:///score", r"has no host"),
        ("http://rm host/", r"contains spaces or control characters"),
    ],
)
def test_only_http_urls_with_a_host_are_accepted(url, message):
    with pytest.raises(UserError, match=message):
        build_scorer(RewardConfig(remote=RemoteRewardConfig(url=url)))
    with pytest.raises(UserError, match=message.replace("reward.remote.url", "RemoteReward.url")):
        RemoteReward(url)


def test_a_file_url_in_a_config_is_one_line_that_echoes_nothing_it_read(tmp_path, capsys):
    from ppokit.cli import main

    secret = tmp_path / "secret.txt"
    secret.write_text("the-secret-content\n")
    (tmp_path / "ppo.yaml").write_text(yaml.safe_dump({
        "model": str(tmp_path / "no-model"), "data": {"train": str(tmp_path / "no-data.jsonl")},
        "reward": {"remote": {"url": secret.as_uri()}},
    }))
    assert main(["ppo", str(tmp_path / "ppo.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "ppokit: error: reward.remote.url: scheme file:// is not supported; use http:// or https://"
    assert "the-secret-content" not in err


class Redirects(BaseHTTPRequestHandler):
    """Answers every POST with `status` and Location `to`."""

    status, to, calls = 302, "", 0

    def do_POST(self):
        type(self).calls += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(self.status)
        self.send_header("Location", self.to)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_elsewhere_is_refused_and_the_credentials_never_leave(monkeypatch, status):
    monkeypatch.setenv("PPOKIT_TEST_TOKEN", "s3cret")
    elsewhere, target = flaky(failures=0)  # another port on the same machine: another origin
    with running(target) as target_url:
        handler = type("Handler", (Redirects,), {"status": status, "to": target_url, "calls": 0})
        with running(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as url:
            remote = RemoteReward(url, max_retries=2, backoff_s=0.01, headers={"Authorization": "Bearer ${PPOKIT_TEST_TOKEN}"})
            with pytest.raises(UserError, match=rf"redirected \(HTTP {status}\) to {target_url} .*follows a redirect only to the same "
                               r"scheme, host and port.*set RemoteReward.url to the new address"):
                remote.score(BATCH)
    assert elsewhere.calls == 0 and elsewhere.headers_seen == []  # not a request, let alone the token
    assert handler.calls == 1  # a refused redirect is not retried


@pytest.mark.parametrize("to", ["file:///etc/hostname", "https://127.0.0.1:{port}/", "ftp://127.0.0.1/x", "http://127.0.0.1:99999/"])
def test_a_redirect_to_another_scheme_is_refused(to):
    handler = type("Handler", (Redirects,), {"status": 307, "calls": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    handler.to = to.format(port=server.server_address[1])
    with running(server) as url:
        with pytest.raises(UserError, match=r"HTTP 307|redirected \(HTTP 307\)") as e:
            RemoteReward(url, max_retries=0).score(BATCH)
    assert "does not follow" in str(e.value) or "follows a redirect only" in str(e.value)


class MovedSlash(Flaky):
    """/score answers 307 to /score/ (as frameworks that add the slash do); /score/ scores."""

    failures = 0

    def do_POST(self):
        if self.path == "/score":
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(307)
            self.send_header("Location", "/score/")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_POST()


def test_a_redirect_on_the_same_host_and_port_is_followed_with_the_post(monkeypatch):
    monkeypatch.setenv("PPOKIT_TEST_TOKEN", "s3cret")
    handler = type("Handler", (MovedSlash,), {"calls": 0, "headers_seen": []})
    with running(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as url:
        remote = RemoteReward(url + "score", max_retries=0, headers={"Authorization": "Bearer ${PPOKIT_TEST_TOKEN}"})
        assert remote.score(BATCH).tolist() == [12.0, 4.0, 9.0]
    assert handler.headers_seen == ["Bearer s3cret"]


@pytest.mark.parametrize(
    "headers, message",
    [
        ({"Authorization": "Bearer ${PPOKIT_UNSET_VARIABLE}"}, r"RemoteReward.headers.Authorization: environment variable PPOKIT_UNSET_VARIABLE is not set"),
        ({"Authorization": "Bearer $PPOKIT_UNSET_VARIABLE"}, r"environment variable PPOKIT_UNSET_VARIABLE is not set"),
        ({"X-Token": "a\r\nX-Injected: 1"}, r"RemoteReward.headers.X-Token: the value .* holds a line break"),
        ({"Bad Name": "x"}, r"'Bad Name' is not a valid HTTP header name"),
        ({"X-Name": "caf\u00e9\u20ac"}, r"holds characters HTTP headers cannot carry"),
    ],
)
def test_bad_headers_are_one_line_before_any_request(headers, message, monkeypatch):
    monkeypatch.delenv("PPOKIT_UNSET_VARIABLE", raising=False)
    with pytest.raises(UserError, match=message):
        RemoteReward("http://127.0.0.1:9/", headers=headers)


# --------------------------------------------------------------------------- a deadline per request, a size cap


class Trickles(BaseHTTPRequestHandler):
    """Answers one byte every `gap_s` seconds, in the status line or in the body; gives up after
    `limit` bytes or when the client has gone, so it always ends by itself."""

    gap_s, limit, where = 0.5, 40, "body"

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"rewards": [1.0, 1.0, 1.0]}).encode().ljust(self.limit)
        head = f"HTTP/1.0 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        slow = head + body if self.where == "head" else body
        try:
            if self.where == "body":
                self.wfile.write(head)
                self.wfile.flush()
            for byte in slow[: self.limit]:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(self.gap_s)
        except OSError:
            pass  # the client hung up

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("where", ["head", "body"])
def test_timeout_s_is_a_deadline_for_the_whole_request_however_slowly_it_trickles(where):
    handler = type("Handler", (Trickles,), {"where": where})
    with running(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as url:
        t0 = time.monotonic()
        with pytest.raises(UserError, match=r"failed 2 time\(s\) \(timeout 1.5s.*last error: no complete answer within timeout_s=1.5s"):
            RemoteReward(url, timeout_s=1.5, max_retries=1, backoff_s=0.01).score(BATCH)
        elapsed = time.monotonic() - t0
        for _ in range(100):  # the requests' sockets were cut at the deadline: their threads end, not after the 20 s
            if not any(thread.name == "remote-remote" for thread in threading.enumerate()):
                break
            time.sleep(0.05)
        assert not any(thread.name == "remote-remote" for thread in threading.enumerate())
    assert elapsed < 15, elapsed  # 2 x 1.5 s (slack for a loaded machine), not 40 bytes x 0.5 s = 20 s per attempt


class Floods(BaseHTTPRequestHandler):
    """Answers `size` bytes (with a Content-Length, or chunked without one), stopping when the client goes."""

    size, chunked = 4 << 20, False
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        block = b" " * (64 << 10)
        if self.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(self.size))
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            for _ in range(self.size // len(block)):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block) if self.chunked else block)
            if self.chunked:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("chunked", [False, True])
def test_an_answer_larger_than_max_response_bytes_fails_the_batch_unread(chunked):
    handler = type("Handler", (Floods,), {"chunked": chunked})
    with running(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as url:
        scorer = build_scorer(RewardConfig(remote=RemoteRewardConfig(url=url, max_retries=0, max_response_bytes=1 << 20)))
        what = f"more than {1 << 20} bytes" if chunked else f"{4 << 20} bytes"
        with pytest.raises(RewardError, match=rf"answered {what}; at most reward.remote.max_response_bytes=1048576 are read"):
            scorer.score(BATCH)
    assert RemoteRewardConfig().max_response_bytes == 16 << 20


# --------------------------------------------------------------------------- serve-rm under load, abuse and a stuck source


def post(url: str, body: bytes, headers: dict | None = None, timeout: float = 10):
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


GOOD = json.dumps({"prompts": ["a"], "completions": ["great"]}).encode()


def test_half_sent_requests_hold_no_thread_and_are_cut_at_the_read_timeout():
    source = function_source({"function": "contains", "required": ["great"]}, "k")
    baseline = threading.active_count()
    with running(make_server(source, port=0, workers=4, read_timeout_s=1.0)) as url:
        port = int(url.rsplit(":", 1)[1].strip("/"))
        t0 = time.monotonic()
        lone = socket.create_connection(("127.0.0.1", port))
        lone.sendall(b"POST / HTTP/1.1\r\nContent-Length: 50\r\n")  # and never the rest
        lone.settimeout(10)
        assert lone.recv(100) in (b"",)  # closed by the server, not left open
        assert 0.5 < time.monotonic() - t0 < 9  # cut at the 1 s read timeout, before the 10 s of our own
        lone.close()
        half = []
        try:
            for _ in range(200):
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"prom")
                half.append(s)
            time.sleep(0.3)
            extra = threading.active_count() - baseline
            assert extra <= 1 + 2, extra  # serve_forever's, slack: a request still arriving takes no thread
        finally:
            for s in half:
                s.close()
        assert RemoteReward(url, max_retries=6, backoff_s=0.2, timeout_s=5).score(BATCH).tolist() == [1.0, 0.0, 1.0]


def test_slow_clients_hold_no_worker_and_a_valid_post_beside_them_is_answered_at_once():
    """45 connections trickling their headers held a valid POST in the queue for over 15 s when each took a worker:
    a request is read in the event loop and takes a worker only once it is in, so it is answered at once."""
    source = function_source({"function": "contains", "required": ["great"]}, "k")
    with running(make_server(source, port=0, workers=4, read_timeout_s=60)) as url:
        port = int(url.rsplit(":", 1)[1].strip("/"))
        slow = []
        try:
            for _ in range(45):
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")  # and the rest never comes
                slow.append(s)
            for _ in range(3):
                t0 = time.monotonic()
                assert post(url, GOOD, timeout=30) == (200, {"rewards": [1.0]})
                assert time.monotonic() - t0 < 5  # milliseconds when quiet; the old queue held it up to read_timeout_s
        finally:
            for s in slow:
                s.close()


def test_with_every_worker_taken_a_post_is_answered_503_at_once():
    """`workers` requests are handled at once; one more is not queued behind them (each may take a scoring call's
    time) but answered 503 at once, and served again once a worker is free."""
    from ppokit.rewards import FunctionReward

    scoring, release = threading.Event(), threading.Event()

    def waits(prompts, completions, **columns):
        scoring.set()
        release.wait(60)  # the test releases it; never longer than a minute
        return [1.0] * len(completions)

    with running(make_server(FunctionReward(waits, "waits"), port=0, workers=1)) as url:
        first = threading.Thread(target=post, args=(url, GOOD), kwargs={"timeout": 60}, daemon=True)
        first.start()
        assert scoring.wait(30)
        t0 = time.monotonic()
        assert post(url, GOOD, timeout=30) == (503, {"error": "busy: every worker is taken; retry later"})
        assert time.monotonic() - t0 < 5
        assert get(url) == (200, {"status": "ok", "source": "waits"})  # the health check needs no worker
        release.set()
        first.join(30)
        assert post(url, GOOD) == (200, {"rewards": [1.0]})


@pytest.mark.parametrize("request_line, status, error", [
    (b"\x00\x01\x02\xff\xfe noise\r\n\r\n", 400, "bad request: the request line or headers are not HTTP/1.1"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400, "bad request:"),  # TLS to a plain-HTTP port
    (b"POST /\r\n\r\n", 400, "bad request:"),  # no version, so no headers
    (b"PUT / HTTP/1.1\r\n\r\n", 400, "bad request:"),  # HTTP/1.1 without its mandatory Host header
    (b"PUT / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405, "Method Not Allowed"),
])
def test_requests_the_http_parser_refuses_get_json_with_a_status_line(request_line, status, error):
    """A binary or header-less request got http.server's HTML page, without even a status line for a
    request line without a version: JSON like every other answer (uvicorn's own refusal is text)."""
    source = function_source({"function": "contains", "required": ["great"]}, "k")
    with running(make_server(source, port=0)) as url:
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1].strip("/"))), timeout=10) as s:
            s.sendall(request_line)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(f"HTTP/1.1 {status} ".encode()) and b"content-type: application/json" in head.lower(), answer
        assert list(json.loads(body)) == ["error"] and json.loads(body)["error"].startswith(error), body
        assert post(url, GOOD) == (200, {"rewards": [1.0]})


def test_a_deeply_nested_body_is_answered_400_and_the_server_carries_on():
    source = function_source({"function": "contains", "required": ["great"]}, "k")
    with running(make_server(source, port=0)) as url:
        status, body = post(url, b'{"prompts": ["a"], "completions": ["b"], "columns": {"x": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}}")
        assert (status, body) == (400, {"error": "bad request: JSON nested too deeply"})
        nested = json.dumps({"prompts": ["a"], "completions": ["b"], "columns": {"x": [json.loads("[" * 100 + "]" * 100)]}})
        assert post(url, nested.encode()) == (400, {"error": "bad request: columns: values nested deeper than 64 levels"})
        assert post(url, GOOD) == (200, {"rewards": [1.0]})


def test_health_and_posts_say_so_when_the_source_is_stuck():
    from ppokit.rewards import FunctionReward

    release = threading.Event()

    def hangs(prompts, completions, **columns):
        release.wait(60)  # the test releases it; never longer than a minute
        return [1.0] * len(completions)

    with running(make_server(FunctionReward(hangs, "hangs"), port=0, stuck_after_s=0.5)) as url:
        assert get(url) == (200, {"status": "ok", "source": "hangs"})
        first = threading.Thread(target=post, args=(url, GOOD), kwargs={"timeout": 30}, daemon=True)
        first.start()
        time.sleep(1.0)
        status, body = get(url)
        assert status == 503 and body["status"] == "stuck" and "scoring one request for" in body["error"]
        t0 = time.monotonic()
        status, body = post(url, GOOD)
        assert status == 503 and body["error"].startswith("busy: the source has been scoring") and time.monotonic() - t0 < 15  # not the stuck call's 60 s
        release.set()
        first.join(10)
        assert get(url) == (200, {"status": "ok", "source": "hangs"})

    release.clear()
    with running(make_server(FunctionReward(hangs, "hangs", timeout_s=0.3), port=0, stuck_after_s=30)) as url:
        status, body = post(url, GOOD)
        assert status == 422 and "did not return within reward.timeout_s=0.3s" in body["error"]
        status, body = get(url)  # the call that passed its deadline still runs
        assert status == 503 and "passed its deadline" in body["error"]
        release.set()
        for _ in range(100):
            if get(url)[0] == 200:
                break
            time.sleep(0.05)
        assert post(url, GOOD) == (200, {"rewards": [1.0]})


def test_a_bearer_token_guards_every_post(monkeypatch):
    source = function_source({"function": "contains", "required": ["great"]}, "k")
    monkeypatch.setenv("PPOKIT_TEST_TOKEN", "s3cret")
    with running(make_server(source, port=0, token="s3cret")) as url:
        status, body = post(url, GOOD)
        assert status == 401 and "Authorization: Bearer" in body["error"]
        assert post(url, GOOD, {"Authorization": "Bearer wrong"})[0] == 401
        assert post(url, GOOD, {"Authorization": "s3cret"})[0] == 401
        with pytest.raises(UserError, match="answered HTTP 401"):
            RemoteReward(url, max_retries=3, backoff_s=0.01).score(BATCH)
        remote = RemoteReward(url, max_retries=0, headers={"Authorization": "Bearer ${PPOKIT_TEST_TOKEN}"})
        assert remote.score(BATCH).tolist() == [1.0, 0.0, 1.0]
        assert get(url) == (200, {"status": "ok", "source": "contains"})  # the health check needs no token


def test_serve_rm_command_with_a_token_from_the_environment(tmp_path):
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "PPOKIT_TEST_TOKEN": "s3cret"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ppokit", "serve-rm", "{function: contains, required: [great]}", "--port", "0", "--token-env", "PPOKIT_TEST_TOKEN"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )
    try:
        line = proc.stdout.readline()
        assert "serving reward source contains at http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" at ")[1].strip()
        assert post(url, GOOD)[0] == 401
        os.environ["PPOKIT_TEST_TOKEN_CLIENT"] = "s3cret"
        try:
            remote = RemoteReward(url, max_retries=0, headers={"Authorization": "Bearer ${PPOKIT_TEST_TOKEN_CLIENT}"})
            assert remote.score(BATCH).tolist() == [1.0, 0.0, 1.0]
        finally:
            del os.environ["PPOKIT_TEST_TOKEN_CLIENT"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


TIMEOUT_RULE = f"in (0, {threading.TIMEOUT_MAX:.0f}] seconds (threading.TIMEOUT_MAX: the longest wait Python takes)"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--token-env", "PPOKIT_UNSET_VARIABLE"], "serve-rm --token-env PPOKIT_UNSET_VARIABLE: the environment variable PPOKIT_UNSET_VARIABLE is not set or "
                                                   "empty"),
        (["--workers", "0"], "serve-rm --workers: 0 is out of range, it must be > 0"),
        (["--read-timeout-s", "-1"], "serve-rm --read-timeout-s: -1.0 is out of range, it must be in (0, "),
        (["--timeout-s", "0"], "serve-rm --timeout-s: 0.0 is out of range, it must be in (0, "),
        # past threading.TIMEOUT_MAX every wait raised OverflowError: every request unanswered or 422
        (["--read-timeout-s", "inf"], f"serve-rm --read-timeout-s: inf is out of range, it must be {TIMEOUT_RULE}"),
        (["--timeout-s", "inf"], "serve-rm --timeout-s: inf is out of range, it must be in (0, "),
        (["--timeout-s", "1e300"], "serve-rm --timeout-s: 1e+300 is out of range, it must be in (0, "),
        (["--stuck-after-s", "nan"], "serve-rm --stuck-after-s: nan is out of range, it must be in (0, "),
        (["--port", "70000"], "serve-rm: cannot listen on 127.0.0.1:70000: bind(): port must be 0-65535"),
        (["--port", "{taken}"], "serve-rm: cannot listen on 127.0.0.1:{taken}: [Errno"),
    ],
)
def test_serve_rm_options_that_cannot_work_are_one_line_and_exit_2(argv, message, capsys, monkeypatch):
    from ppokit.cli import main

    monkeypatch.delenv("PPOKIT_UNSET_VARIABLE", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        argv = [a.replace("{taken}", port) for a in argv]
        assert main(["serve-rm", "sentiment", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ppokit: error: " + message.replace("{taken}", port)) and len(err.splitlines()) == 1, err


class RawAnswer(BaseHTTPRequestHandler):
    body = b""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    "body, message",
    [
        (b'{"rewards": ["0.5", "0.5", "0.5"]}', r"remote reward remote returned '0.5' \(a str\) for row 0: prompt 'q1'"),
        (b'{"rewards": "111"}', r'answered .*; expected \{"rewards": \[\.\.\.\]\}'),
        (b'{"rewards": [true, false, 1]}', None),
        (b"[" * 100_000 + b"]" * 100_000, "answered something that is not JSON"),
    ],
)
def test_a_remote_answer_of_strings_or_deep_nesting_is_a_failed_batch(body, message):
    handler = type("Handler", (RawAnswer,), {"body": body})
    with running(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as url:
        remote = RemoteReward(url, max_retries=0)
        if message is None:
            assert remote.score(BATCH).tolist() == [1.0, 0.0, 1.0]
        else:
            with pytest.raises(RewardError, match=message):
                remote.score(BATCH)


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory):
    """A certificate for 127.0.0.1 and its key, made by the openssl command."""
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(folder / "key.pem"), "-out", str(folder / "cert.pem"),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    return folder / "cert.pem", folder / "key.pem"


def tls(server, cert, key):
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    return server


def test_https_verifies_the_certificate_and_keeps_the_deadline(self_signed, monkeypatch):
    cert, key = self_signed
    _, server = flaky(failures=0)
    with running(tls(server, cert, key)) as url:
        url = url.replace("http://", "https://")
        with pytest.raises(UserError, match="CERTIFICATE_VERIFY_FAILED"):
            RemoteReward(url, max_retries=0).score(BATCH)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trust it, as a private CA would be
        assert RemoteReward(url, max_retries=0).score(BATCH).tolist() == [12.0, 4.0, 9.0]
    with running(tls(ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (Trickles,), {"where": "body"})), cert, key)) as url:
        t0 = time.monotonic()
        with pytest.raises(UserError, match="no complete answer within timeout_s=1.5s"):
            RemoteReward(url.replace("http://", "https://"), timeout_s=1.5, max_retries=0).score(BATCH)
        assert time.monotonic() - t0 < 15  # 1.5 s, not 40 bytes x 0.5 s = 20 s
