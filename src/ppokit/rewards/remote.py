"""Rewards over HTTP: a client source and `ppokit serve-rm`, which serves any source.

The protocol, one POST per batch of rows:
    request   {"prompts": [str], "completions": [str], "columns": {name: [value per row]}}
    response  {"rewards": [number or null per row]}       (null: that row failed)
    errors    HTTP 4xx/5xx with {"error": "message"}; 422 means the source failed on this data.
Connection errors, timeouts, 429 and 5xx are retried with exponential back-off; after the last
retry the run stops with the last error. A missing or non-finite score is never read as 0.

What the client will not do: talk anything but http:// or https://; follow a redirect to another
scheme, host or port (the configured headers, credentials included, would go there); wait past
`timeout_s` for one request, however slowly the server trickles its answer; read an answer larger
than `max_response_bytes`. What the server will not do: give a connection more than
`read_timeout_s` to send its request, run more than `workers` handlers at once or keep a
connection waiting for one (when every worker is taken it gets 503 at once), parse a body nested
deeper than MAX_NESTING levels, answer a POST without the bearer token when one is set, or answer
anything but JSON (http.server's own refusals, e.g. of a binary request line, included).
"""

from __future__ import annotations

import collections
import hmac
import http.client
import ipaddress
import json
import math
import os
import queue
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Optional
from urllib.parse import urlsplit

import torch

from ppokit.config.schema import http_url_problem
from ppokit.errors import UserError
from ppokit.process.workers import DeadlineExceeded, ThreadCall
from ppokit.rewards.sources import RewardError, RewardSource, ScoringBatch, check_scores

MAX_BACKOFF_S = 30.0
MAX_ERROR_BODY_BYTES = 64 << 10  # of an error answer, enough for its message
MAX_NESTING = 64  # levels of lists/objects in a request's column values
REDIRECTS_FOLLOWED = (301, 302, 307, 308)  # re-sent as the same POST, to the same origin only
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VARIABLE = re.compile(r"\$(\w+)|\$\{([^}]*)\}")


class _Retry(Exception):
    """One attempt failed in a way worth retrying (connection, deadline, HTTP 429/5xx)."""


@dataclass
class RemoteReward:
    """A reward source behind HTTP (the `reward.remote` section).

    `timeout_s` is a deadline for each whole request; `key` is how error messages name these
    settings (`reward.remote` when they come from a config).
    """

    url: str
    timeout_s: float = 60.0
    max_retries: int = 3
    backoff_s: float = 1.0
    batch_size: int = 64
    headers: dict = field(default_factory=dict)
    name: str = "remote"
    max_response_bytes: int = 16 << 20
    key: str = "RemoteReward"

    def __post_init__(self):
        problem = http_url_problem(self.url)
        if problem:
            raise UserError(f"{self.key}.url: {problem}")
        self._request_headers()  # an unset ${VAR} or a malformed header fails now, not at the first update

    def score(self, batch: ScoringBatch) -> torch.Tensor:
        n = len(batch)
        return torch.cat([self._post(batch.select(list(range(i, min(i + self.batch_size, n))))) for i in range(0, n, self.batch_size)])

    def _request_headers(self) -> dict[str, str]:
        """Content-Type plus the configured headers, `${VAR}`/`$VAR` read from the environment now."""
        headers = {"Content-Type": "application/json"}
        for name, value in self.headers.items():
            key = f"{self.key}.headers.{name}"
            if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
                raise UserError(f"{self.key}.headers: {name!r} is not a valid HTTP header name")

            def expand(match, key=key):
                variable = match.group(1) or match.group(2)
                if variable not in os.environ:
                    raise UserError(f"{key}: environment variable {variable or '(empty name)'} is not set")
                return os.environ[variable]

            text = _VARIABLE.sub(expand, str(value))
            if any(c in text for c in "\r\n\0"):
                raise UserError(f"{key}: the value (after ${{VAR}} expansion) holds a line break or NUL")
            try:
                text.encode("latin-1")
            except UnicodeEncodeError:
                raise UserError(f"{key}: the value (after ${{VAR}} expansion) holds characters HTTP headers cannot carry") from None
            headers[name] = text
        return headers

    def _post(self, batch: ScoringBatch) -> torch.Tensor:
        body = json.dumps(
            {"prompts": batch.prompts, "completions": batch.completions, "columns": batch.columns}, default=str
        ).encode()
        headers = self._request_headers()
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                status, payload = self._exchange(body, headers)
            except _Retry as e:
                last_error = str(e)
                continue
            if 200 <= status < 300:
                return self._parse(payload, batch)
            detail = _error_detail(payload, status)
            if status == 429 or status >= 500:
                last_error = f"HTTP {status}: {detail}"
                continue
            if status == 422:
                raise RewardError(f"remote reward {self.name} ({self.url}) failed on this batch: {detail}{batch.first_row()}")
            if 300 <= status < 400:
                raise UserError(
                    f"remote reward {self.name}: {self.url} answered HTTP {status} (a redirect) that ppokit does not follow; "
                    f"set {self.key}.url to the address that answers the POST"
                )
            raise UserError(f"remote reward {self.name}: {self.url} answered HTTP {status}: {detail}")
        raise UserError(
            f"remote reward {self.name}: POST {self.url} failed {self.max_retries + 1} time(s) "
            f"(timeout {self.timeout_s:g}s, {self.key}.max_retries={self.max_retries}); last error: {last_error}"
        )

    def _exchange(self, body: bytes, headers: dict) -> tuple[int, bytes]:
        """One POST, redirects included, under one deadline -> (status, answer body)."""
        sockets = _Sockets()  # every socket of this request, to cut at the deadline
        opener = urllib.request.OpenerDirector()  # http and https only: no file://, ftp:// or data: handlers
        for handler in (
            urllib.request.ProxyHandler(), _WatchedHTTPHandler(sockets), _WatchedHTTPSHandler(sockets), _SameOriginRedirects(self),
            urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor(),
        ):
            opener.add_handler(handler)
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")

        def talk():
            try:
                with opener.open(request, timeout=self.timeout_s) as response:
                    return response.status, self._read(response, self.max_response_bytes)
            except urllib.error.HTTPError as e:
                with e:
                    return e.code, self._read(e, MAX_ERROR_BODY_BYTES, truncate=True)

        call = ThreadCall(talk, name=f"remote-{self.name}")
        try:
            return call.result(self.timeout_s)
        except DeadlineExceeded:
            sockets.cut_all()  # the request's thread wakes up and ends
            raise _Retry(f"no complete answer within timeout_s={self.timeout_s:g}s") from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            raise _Retry(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None

    def _read(self, response, limit: int, truncate: bool = False) -> bytes:
        """The answer body, at most `limit` bytes: with `truncate` the rest is left unread, else a
        larger answer is a RewardError, found from Content-Length or while reading."""
        length = response.headers.get("Content-Length")
        if not truncate and length is not None and length.strip().isdigit() and int(length) > limit:
            raise RewardError(self._too_large(f"{int(length)} bytes"))
        chunks, size = [], 0
        while size <= limit:
            chunk = response.read1(min(1 << 16, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            if truncate:
                return b"".join(chunks)[:limit]
            raise RewardError(self._too_large(f"more than {limit} bytes"))
        return b"".join(chunks)

    def _too_large(self, what: str) -> str:
        return f"remote reward {self.name} ({self.url}) answered {what}; at most {self.key}.max_response_bytes={self.max_response_bytes} are read"

    def _parse(self, payload: bytes, batch: ScoringBatch) -> torch.Tensor:
        try:
            data = json.loads(payload)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise RewardError(f"remote reward {self.name} ({self.url}) answered something that is not JSON: {payload[:200]!r}") from None
        if not isinstance(data, dict) or not isinstance(data.get("rewards"), list):
            raise RewardError(f"remote reward {self.name} ({self.url}) answered {str(data)[:200]}; expected {{\"rewards\": [...]}}")
        return check_scores(data["rewards"], batch, self.name, what="remote reward")


def _error_detail(payload: bytes, status: int) -> str:
    try:
        return str(json.loads(payload).get("error", payload[:300]))
    except Exception:
        return payload[:300].decode("utf-8", "replace") or http.client.responses.get(status, "error")


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme, 0)


class _Sockets:
    """The sockets one request opens. After `cut_all`, a socket opened late (the request's thread
    was still resolving the name at the deadline) is cut as soon as it is added."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._cut = False

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.append(sock)
            if self._cut:
                _cut(sock)

    def cut_all(self) -> None:
        with self._lock:
            self._cut = True
            for sock in self._open:
                _cut(sock)


def _cut(sock: socket.socket) -> None:
    """Shut a socket down from another thread, so a blocking read in its own thread returns."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's, also under a TLS socket
    except OSError:
        pass  # closed already, or handed over to the TLS socket


def _watched(base: type, sockets: _Sockets) -> type:
    """An http.client connection class that records each socket it opens in `sockets`."""

    class Watched(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            create = self._create_connection

            def create_and_record(*a, **k):
                sock = create(*a, **k)
                sockets.add(sock)
                return sock

            self._create_connection = create_and_record

        def connect(self):
            super().connect()
            sockets.add(self.sock)  # the TLS socket, once the handshake is done

    return Watched


class _WatchedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, sockets: _Sockets):
        super().__init__()
        self._sockets = sockets

    def http_open(self, req):
        return self.do_open(_watched(http.client.HTTPConnection, self._sockets), req)


class _WatchedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, sockets: _Sockets):
        super().__init__()
        self._sockets = sockets

    def https_open(self, req):
        return self.do_open(_watched(http.client.HTTPSConnection, self._sockets), req, context=self._context)


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follow a redirect only to the configured URL's scheme, host and port, re-sending the POST
    (body and headers); anything else stops the run with a line naming the target."""

    def __init__(self, client: RemoteReward):
        self.client = client

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        c = self.client
        if code in REDIRECTS_FOLLOWED and _origin(newurl) == _origin(c.url):
            return urllib.request.Request(newurl, data=req.data, headers=req.headers, method="POST")
        fp.close()
        why = f"HTTP {code} asks for a GET" if code not in REDIRECTS_FOLLOWED else "another scheme, host or port"
        raise UserError(
            f"remote reward {c.name}: {c.url} redirected (HTTP {code}) to {newurl} ({why}); ppokit follows a redirect only "
            f"to the same scheme, host and port, so that {c.key}.headers never go elsewhere: set {c.key}.url to the new "
            "address if you trust it"
        )

    http_error_308 = urllib.request.HTTPRedirectHandler.http_error_302  # Python 3.10 lacks it


# --------------------------------------------------------------------------- server


def _request_batch(data, max_rows: int) -> ScoringBatch:
    """A decoded request body -> ScoringBatch; ValueError says what is wrong with it."""
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object {prompts, completions, columns}")
    prompts, completions, columns = data.get("prompts"), data.get("completions"), data.get("columns", {})
    for key, value in (("prompts", prompts), ("completions", completions)):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{key}: expected a list of strings")
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if len(prompts) > max_rows:
        raise ValueError(f"{len(prompts)} rows; this server takes at most {max_rows} per request")
    if not isinstance(columns, dict) or not all(isinstance(v, list) and len(v) == len(prompts) for v in columns.values()):
        raise ValueError("columns: expected an object of lists, one value per row")
    if _nested_deeper_than(columns, MAX_NESTING):
        raise ValueError(f"columns: values nested deeper than {MAX_NESTING} levels")
    return ScoringBatch(prompts, completions, columns)


def _nested_deeper_than(value, limit: int) -> bool:
    """Whether lists/objects in `value` nest more than `limit` levels (without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


REFUSED_LINGER_S = 1.0  # a connection answered 503 stays open this long for the answer to be read
MAX_REFUSED_LINGERING = 256  # at most this many at once (file descriptors); the oldest are closed first


class PooledHTTPServer(HTTPServer):
    """An HTTPServer whose connections are handled by a fixed pool of daemon threads.

    An accepted connection goes to an idle worker; when every worker is taken it is answered 503 at
    once and closed. None waits in a queue: a queue would hold a valid request behind slow clients,
    each of which may keep its worker for `read_timeout_s`. So no number of slow or idle clients can
    take more threads than `workers` (plus one deadline timer per busy worker) or delay an answer.
    """

    request_queue_size = 128  # the listen backlog, before accept

    def __init__(self, address, handler, workers: int):
        self._idle = threading.Semaphore(workers)  # taken by each connection handed to a worker until it is done
        self._waiting: queue.Queue = queue.Queue()  # never more than `workers` items: each holds an idle worker
        self._refused: collections.deque = collections.deque()  # (close at, socket) of connections answered 503
        self._closing = threading.Event()
        try:
            super().__init__(address, handler)
        except (OSError, OverflowError) as e:  # port taken, not an address of this machine, port out of range
            raise UserError(f"serve-rm: cannot listen on {address[0]}:{address[1]}: {e}") from None
        self._threads = [threading.Thread(target=self._work, name=f"serve-rm-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def process_request(self, request, client_address):
        if self._idle.acquire(blocking=False):
            self._waiting.put((request, client_address))
            return
        body = json.dumps({"error": "busy: every worker is taken; retry later"}).encode()
        try:
            request.settimeout(1.0)
            request.sendall(
                b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
            )
            request.shutdown(socket.SHUT_WR)
        except OSError:
            self.shutdown_request(request)
            return
        # Closed at once, a socket whose request was not read (or arrives after the answer) is reset, and the
        # reset can reach the client before it reads the 503: it is closed a little later, its input drained.
        self._refused.append((time.monotonic() + REFUSED_LINGER_S, request))
        self._close_refused()

    def _close_refused(self, everything: bool = False) -> None:
        now = time.monotonic()
        while self._refused and (everything or self._refused[0][0] <= now or len(self._refused) > MAX_REFUSED_LINGERING):
            _, request = self._refused.popleft()
            try:
                request.setblocking(False)
                while request.recv(65536):
                    pass
            except OSError:
                pass
            request.close()

    def service_actions(self):
        self._close_refused()

    def _work(self):
        while not self._closing.is_set():
            try:
                request, client_address = self._waiting.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self.finish_request(request, client_address)
            except BaseException as e:  # a worker must outlive any request, SystemExit from a source included
                self.handle_error(request, client_address, e)
            finally:
                self.shutdown_request(request)
                self._idle.release()

    def handle_error(self, request, client_address, error: Optional[BaseException] = None):
        error = error or sys.exc_info()[1]
        if isinstance(error, (BrokenPipeError, ConnectionResetError)):
            return  # the client left, or was cut at read_timeout_s: nobody to answer, nothing wrong here
        sys.stderr.write(f"serve-rm: request from {client_address[0]} failed: {type(error).__name__}: {error}\n")

    def server_close(self):
        super().server_close()
        self._closing.set()
        self._close_refused(everything=True)
        while True:
            try:
                request, _ = self._waiting.get_nowait()
            except queue.Empty:
                break
            self.shutdown_request(request)


def make_server(
    source: RewardSource, host: str = "127.0.0.1", port: int = 8000, max_request_bytes: int = 16 << 20, max_rows: int = 4096,
    verbose: bool = False, workers: int = 8, read_timeout_s: float = 30.0, stuck_after_s: float = 60.0, token: Optional[str] = None,
) -> PooledHTTPServer:
    """An HTTP server scoring with `source`, one batch at a time; `port` 0 picks a free port.

    read_timeout_s   a connection must deliver its whole request within this time (else it is closed)
    workers          connections handled at once; any more get 503 at once
    stuck_after_s    a scoring call running longer than this makes GET / answer 503 and new POSTs
                     get 503 instead of waiting behind it
    token            when set, a POST needs `Authorization: Bearer <token>` (compared in constant time)
    """
    lock = threading.Lock()
    busy = {"since": None}  # time.monotonic() when the scoring call in progress started
    expected = None if token is None else f"Bearer {token}".encode()

    def stuck() -> Optional[str]:
        """Why the source cannot take a request now, or None."""
        abandoned = getattr(source, "stuck_s", lambda: None)()
        if abandoned is not None:
            return f"the source's call that passed its deadline {abandoned:.0f}s ago has not returned"
        since = busy["since"]
        if since is not None and time.monotonic() - since > stuck_after_s:
            return f"the source has been scoring one request for {time.monotonic() - since:.0f}s (more than {stuck_after_s:g}s)"
        return None

    class Handler(BaseHTTPRequestHandler):
        timeout = read_timeout_s  # every socket read
        # A request line without a version (HTTP/0.9, or binary noise) is answered as HTTP/1.0: with a status
        # line and headers, so a client can tell an error from a score.
        default_request_version = "HTTP/1.0"

        def setup(self):
            super().setup()
            # The whole request (line, headers, body) within read_timeout_s, however slowly it trickles.
            self._deadline = threading.Timer(read_timeout_s, _cut, (self.connection,))
            self._deadline.daemon = True
            self._deadline.start()

        def finish(self):
            self._deadline.cancel()
            try:
                super().finish()
            except OSError:
                pass

        def _reply(self, status: int, body: dict, headers: Optional[dict] = None) -> None:
            self._deadline.cancel()
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
            # http.server's own refusals (a request line or headers it cannot parse, a method it has no
            # handler for) in JSON like every other answer, not its HTML page.
            self.close_connection = True
            self._reply(code, {"error": message or self.responses.get(code, ("error",))[0]}, {"Connection": "close"})

        def _discard_body(self, length: int) -> None:
            # Read a small refused body, so closing the socket does not reset the answer away.
            if 0 < length <= MAX_ERROR_BODY_BYTES:
                self.rfile.read(length)

        def do_GET(self):
            problem = stuck()
            if problem:
                return self._reply(503, {"status": "stuck", "source": source.name, "error": problem})
            self._reply(200, {"status": "ok", "source": source.name})

        def do_POST(self):
            length = self.headers.get("Content-Length")
            if length is None or not length.strip().isdigit():
                self.close_connection = True
                return self._reply(411, {"error": "a Content-Length header is required"})
            length = int(length)
            if expected is not None and not hmac.compare_digest(self.headers.get("Authorization", "").encode("latin-1"), expected):
                self._discard_body(length)
                return self._reply(401, {"error": "missing or wrong token: send Authorization: Bearer <token>"}, {"WWW-Authenticate": "Bearer"})
            if length > max_request_bytes:
                self.close_connection = True
                self._discard_body(length)
                return self._reply(413, {"error": f"request of {length} bytes; at most {max_request_bytes}"})
            body = self.rfile.read(length)
            if len(body) < length:
                return  # the client stopped sending, or was cut at read_timeout_s: nobody to answer
            self._deadline.cancel()
            try:
                batch = _request_batch(json.loads(body), max_rows)
            except RecursionError:
                return self._reply(400, {"error": "bad request: JSON nested too deeply"})
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError included
                return self._reply(400, {"error": f"bad request: {e}"})
            while not lock.acquire(timeout=0.25):
                problem = stuck()
                if problem:
                    return self._reply(503, {"error": f"busy: {problem}"}, {"Retry-After": "5"})
            busy["since"] = time.monotonic()
            try:
                scores = source.score(batch) if len(batch) else torch.zeros(0)
            except UserError as e:
                return self._reply(422, {"error": str(e)})
            except (Exception, SystemExit) as e:
                return self._reply(500, {"error": f"{type(e).__name__}: {e}"})
            finally:
                busy["since"] = None
                lock.release()
            self._reply(200, {"rewards": [v if math.isfinite(v) else None for v in scores.tolist()]})

        def log_message(self, format, *args):
            if verbose:
                sys.stderr.write(f"serve-rm: {self.address_string()} {format % args}\n")

    return PooledHTTPServer((host, port), Handler, workers=workers)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(source: RewardSource, host: str = "127.0.0.1", port: int = 8000, **options) -> None:
    """Serve until interrupted; prints the URL (with the real port when `port` is 0) first."""
    server = make_server(source, host, port, **options)
    if options.get("token") is None and not is_loopback(host):
        print(f"serve-rm: warning: listening on {host} without a token: anyone who can reach this port can use the scorer "
              "(see --token-env)", file=sys.stderr, flush=True)
    print(f"serving reward source {source.name} at http://{host}:{server.server_address[1]}/", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
