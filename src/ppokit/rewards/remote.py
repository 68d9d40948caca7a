"""Rewards over HTTP: a client source and `ppokit serve-rm`, which serves any source.

The protocol, one POST per batch of rows:
    request   {"prompts": [str], "completions": [str], "columns": {name: [value per row]}}
    response  {"rewards": [number or null per row]}       (null: that row failed)
    errors    HTTP 4xx/5xx with {"error": "message"}; 422 means the source failed on this data.
Connection errors, timeouts, 429 and 5xx are retried with exponential back-off; after the last
retry the run stops with the last error. A missing or non-finite score is never read as 0.

The client is httpx and the server starlette on uvicorn, ppokit's one HTTP stack (docs/architecture.md).

What the client will not do: talk anything but http:// or https://; follow a redirect to another
scheme, host or port (the configured headers, credentials included, would go there); wait past
`timeout_s` for one request, however slowly the server trickles its answer; read an answer larger
than `max_response_bytes`. What the server will not do: give a client more than `read_timeout_s`
to send its request, run more than `workers` requests at once or keep one waiting for a worker
(when every worker is taken it gets 503 at once), parse a body nested deeper than MAX_NESTING
levels, answer a POST without the bearer token when one is set, or answer anything but JSON
(requests the HTTP parser refuses, e.g. a binary request line, included).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import math
import os
import re
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlsplit

import h11
import httpx
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from ppokit.config.schema import http_url_problem
from ppokit.errors import UserError
from ppokit.process.hosts import is_loopback
from ppokit.process.workers import DeadlineExceeded, ThreadCall
from ppokit.rewards.sources import RewardError, RewardSource, ScoringBatch, check_scores

MAX_BACKOFF_S = 30.0
MAX_ERROR_BODY_BYTES = 64 << 10  # of an error answer, enough for its message
MAX_NESTING = 64  # levels of lists/objects in a request's column values
REDIRECTS_FOLLOWED = (301, 302, 307, 308)  # re-sent as the same POST, to the same origin only
REDIRECTS = (*REDIRECTS_FOLLOWED, 303)  # 303 asks for a GET: refused with the others that leave the origin
MAX_REDIRECTS = 10  # in one request
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
        """One POST, redirects included, under one deadline -> (status, answer body).

        httpx's timeouts bound each read, not the whole: a server that trickles a byte at a time
        keeps every read short. So the request runs in a thread of its own and its sockets (httpx's
        `trace` extension hands each over as it opens) are cut at the deadline, wherever it is:
        resolving the name, connecting, sending, or reading the status line, headers or body."""
        sockets = _Sockets()

        def record(event: str, info: dict) -> None:
            if event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
                sock = info["return_value"].get_extra_info("socket")
                if sock is not None:
                    sockets.add(sock)

        def talk():
            # Accept-Encoding identity: max_response_bytes counts the bytes as sent, not as decompressed
            with httpx.Client(verify=self._tls, timeout=self.timeout_s, follow_redirects=False,
                              headers={"Accept-Encoding": "identity"}) as client:
                url = self.url
                for _ in range(MAX_REDIRECTS + 1):
                    with client.stream("POST", url, content=body, headers=headers, extensions={"trace": record}) as response:
                        status = response.status_code
                        if status in REDIRECTS and "Location" in response.headers:
                            url = self._redirect_target(status, response)
                            continue
                        if 200 <= status < 300:
                            return status, self._read(response, self.max_response_bytes)
                        return status, self._read(response, MAX_ERROR_BODY_BYTES, truncate=True)
                raise UserError(f"remote reward {self.name}: {self.url} redirected more than {MAX_REDIRECTS} times; "
                                f"set {self.key}.url to the address that answers the POST")

        call = ThreadCall(talk, name=f"remote-{self.name}")
        try:
            return call.result(self.timeout_s)
        except DeadlineExceeded:
            sockets.cut_all()  # the request's thread wakes up and ends
            raise _Retry(f"no complete answer within timeout_s={self.timeout_s:g}s") from None
        except (httpx.TransportError, OSError) as e:
            raise _Retry(f"{type(e).__name__}: {e}") from None

    @functools.cached_property
    def _tls(self) -> ssl.SSLContext:
        """The system's trust store, as every TLS client of this machine (SSL_CERT_FILE and SSL_CERT_DIR
        honoured), rather than httpx's default of certifi's bundle: a private CA installed there is trusted."""
        return ssl.create_default_context()

    def _redirect_target(self, status: int, response: httpx.Response) -> str:
        """Where a redirect that may be followed goes; a UserError naming the target for any other."""
        try:
            target = str(response.url.join(response.headers["Location"]))
        except httpx.InvalidURL:
            target = response.headers["Location"]
        if status in REDIRECTS_FOLLOWED and _origin(target) == _origin(self.url):
            return target
        why = f"HTTP {status} asks for a GET" if status not in REDIRECTS_FOLLOWED else "another scheme, host or port"
        raise UserError(
            f"remote reward {self.name}: {self.url} redirected (HTTP {status}) to {target} ({why}); ppokit follows a redirect "
            f"only to the same scheme, host and port, so that {self.key}.headers never go elsewhere: set {self.key}.url to "
            "the new address if you trust it"
        )

    def _read(self, response: httpx.Response, limit: int, truncate: bool = False) -> bytes:
        """The answer body, at most `limit` bytes: with `truncate` the rest is left unread, else a
        larger answer is a RewardError, found from Content-Length or while reading."""
        length = response.headers.get("Content-Length")
        if not truncate and length is not None and length.strip().isdigit() and int(length) > limit:
            raise RewardError(self._too_large(f"{int(length)} bytes"))
        chunks, size = [], 0
        for chunk in response.iter_raw():
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
        return payload[:300].decode("utf-8", "replace") or httpx.codes.get_reason_phrase(status) or "error"


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port or {"http": 80, "https": 443}.get(scheme, 0)
    except ValueError:  # a port out of range or not a number: no origin ppokit talks to
        port = -1
    return scheme, (parts.hostname or "").lower(), port


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
        pass  # closed already, or handed over to the TLS socket (during the handshake, which httpx's timeout bounds)




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


GRACE_S = 5.0  # at SIGINT/SIGTERM, answers in progress get this long to finish before the server stops


class _Scorer:
    """The source behind the server: one scoring call at a time, and whether it is stuck."""

    def __init__(self, source: RewardSource, max_rows: int, stuck_after_s: float):
        self.source, self.max_rows, self.stuck_after_s = source, max_rows, stuck_after_s
        self._lock = threading.Lock()
        self._since: Optional[float] = None  # time.monotonic() when the scoring call in progress started

    def stuck(self) -> Optional[str]:
        """Why the source cannot take a request now, or None."""
        abandoned = getattr(self.source, "stuck_s", lambda: None)()
        if abandoned is not None:
            return f"the source's call that passed its deadline {abandoned:.0f}s ago has not returned"
        since = self._since
        if since is not None and time.monotonic() - since > self.stuck_after_s:
            return f"the source has been scoring one request for {time.monotonic() - since:.0f}s (more than {self.stuck_after_s:g}s)"
        return None

    def answer(self, body: bytes) -> tuple[int, dict, dict]:
        """A POST's body -> (status, JSON answer, headers). Runs in a worker thread: it parses, waits for the
        source and scores, all of which may take long."""
        try:
            batch = _request_batch(json.loads(body), self.max_rows)
        except RecursionError:
            return 400, {"error": "bad request: JSON nested too deeply"}, {}
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError included
            return 400, {"error": f"bad request: {e}"}, {}
        while not self._lock.acquire(timeout=0.25):
            problem = self.stuck()
            if problem:
                return 503, {"error": f"busy: {problem}"}, {"Retry-After": "5"}
        self._since = time.monotonic()
        try:
            scores = self.source.score(batch) if len(batch) else torch.zeros(0)
        except UserError as e:
            return 422, {"error": str(e)}, {}
        except (Exception, SystemExit) as e:
            return 500, {"error": f"{type(e).__name__}: {e}"}, {}
        finally:
            self._since = None
            self._lock.release()
        return 200, {"rewards": [v if math.isfinite(v) else None for v in scores.tolist()]}, {}


def _app(scorer: _Scorer, max_request_bytes: int, workers: int, token: Optional[str], verbose: bool) -> Starlette:
    """The ASGI application: GET (any path) is the health check, POST (any path) scores; every answer is JSON.

    A POST's body is read in the event loop, where a slow client holds no thread; it is then handled in a
    thread of its own, at most `workers` at once: one that finds them all taken is answered 503 at once
    (a queue would hold it behind requests that may each take a scoring call's time)."""
    expected = None if token is None else f"Bearer {token}".encode()
    workers_free = threading.Semaphore(workers)

    def reply(request: Request, status: int, body: dict, headers: Optional[dict] = None) -> JSONResponse:
        if verbose:
            client = request.client.host if request.client else "-"
            sys.stderr.write(f"serve-rm: {client} {request.method} {request.url.path} {status}\n")
        return JSONResponse(body, status, headers)

    async def health(request: Request) -> JSONResponse:
        problem = scorer.stuck()
        if problem:
            return reply(request, 503, {"status": "stuck", "source": scorer.source.name, "error": problem})
        return reply(request, 200, {"status": "ok", "source": scorer.source.name})

    async def score(request: Request) -> JSONResponse:
        length = request.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            return reply(request, 411, {"error": "a Content-Length header is required"})
        if expected is not None and not hmac.compare_digest(request.headers.get("Authorization", "").encode("latin-1"), expected):
            return reply(request, 401, {"error": "missing or wrong token: send Authorization: Bearer <token>"}, {"WWW-Authenticate": "Bearer"})
        if int(length) > max_request_bytes:
            return reply(request, 413, {"error": f"request of {int(length)} bytes; at most {max_request_bytes}"})
        try:
            body = await request.body()  # uvicorn's parser stops at Content-Length
        except ClientDisconnect:  # the client left, or was cut at read_timeout_s: nobody to answer
            return JSONResponse({"error": "the client left"}, 400)
        if not workers_free.acquire(blocking=False):
            return reply(request, 503, {"error": "busy: every worker is taken; retry later"}, {"Retry-After": "1"})
        status, answer, headers = await _in_thread(scorer.answer, body, done=workers_free.release)
        return reply(request, status, answer, headers)

    async def refused(request: Request, error: Exception) -> JSONResponse:
        if isinstance(error, HTTPException):  # starlette's own: a method other than GET and POST
            return reply(request, error.status_code, {"error": error.detail}, error.headers)
        return reply(request, 500, {"error": f"{type(error).__name__}: {error}"})

    return Starlette(
        routes=[Route("/{path:path}", health, methods=["GET"]), Route("/{path:path}", score, methods=["POST"])],
        exception_handlers={HTTPException: refused, Exception: refused},
    )


async def _in_thread(fn: Callable, *args, done: Callable[[], None]):
    """fn(*args) in a daemon thread of its own, then `done()` there. Not a pool's thread: those are joined at
    exit, and a source stuck in a call would then keep the stopped server's process alive."""
    loop = asyncio.get_running_loop()
    answer = loop.create_future()

    def settle(value, error) -> None:
        if not answer.done():
            answer.set_exception(error) if error is not None else answer.set_result(value)

    def run() -> None:
        value = error = None
        try:
            value = fn(*args)
        except BaseException as e:  # handed to the waiting request, which answers 500
            error = e
        finally:
            done()
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:
            pass  # the server stopped meanwhile: nobody waits for this answer

    threading.Thread(target=run, name="serve-rm-worker", daemon=True).start()
    return await answer


class _Connection(H11Protocol):
    """uvicorn's HTTP/1.1 connection with what serve-rm adds to it.

    - A deadline for each request: the client must send it whole (request line, headers, body) within
      `read_timeout_s` of the connection opening or of the previous answer, however slowly it trickles;
      else the connection is closed unanswered. uvicorn bounds only the wait between requests.
    - A request the HTTP parser refuses (binary noise, no HTTP version, TLS to this plain port) is answered
      in JSON like every other, not uvicorn's text.
    """

    def __init__(self, *args, read_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout_s = read_timeout_s
        self._deadline: Optional[asyncio.TimerHandle] = None
        self._client_state = None  # h11's state of the client when last looked at

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc) -> None:
        self._stop_deadline()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """The deadline runs while the client owes a request (h11: IDLE, then SEND_BODY), from when it became
        owed (IDLE again after an answer); it stops once the request is in."""
        state = self.conn.their_state
        if state not in (h11.IDLE, h11.SEND_BODY) or self.transport.is_closing():
            self._stop_deadline()
        elif self._deadline is None or (state is h11.IDLE and self._client_state is not h11.IDLE):
            self._stop_deadline()
            self._deadline = self.loop.call_later(self.read_timeout_s, self.transport.close)
        self._client_state = state

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def send_400_response(self, msg: str) -> None:
        body = json.dumps({"error": "bad request: the request line or headers are not HTTP/1.1"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            pass  # an answer was under way already: only closing is left
        self.transport.close()


class RewardServer:
    """serve-rm's server: listening from its creation (`server_address` holds the port picked for port 0),
    answering from `serve_forever` until `shutdown`, or, in the main thread, until SIGINT or SIGTERM
    (uvicorn stops gracefully, GRACE_S at most, then the signal acts as it would have: Ctrl-C raises
    KeyboardInterrupt, SIGTERM ends the process)."""

    def __init__(self, app: Starlette, host: str, port: int, read_timeout_s: float, verbose: bool):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self.socket = socket.create_server((host, port), family=family, backlog=128)
        except (OSError, OverflowError) as e:  # port taken, not an address of this machine, port out of range
            raise UserError(f"serve-rm: cannot listen on {host}:{port}: {e}") from None
        self.server_address = self.socket.getsockname()[:2]
        config = uvicorn.Config(
            app, http=functools.partial(_Connection, read_timeout_s=read_timeout_s), loop="asyncio", interface="asgi3",
            lifespan="off", ws="none", proxy_headers=False, server_header=False, timeout_graceful_shutdown=GRACE_S,
            # uvicorn's loggers as they are (no dictConfig of the process's logging); its warnings (a request the
            # parser refused) with --verbose only; the requests are logged by the app
            log_config=None, log_level="warning" if verbose else "error", access_log=False,
        )
        self._server = uvicorn.Server(config)
        self._serving, self._stopped = threading.Event(), threading.Event()

    def serve_forever(self, on_ready: Optional[Callable[[], None]] = None) -> None:
        """Serve until `shutdown` or a signal; `on_ready()` once uvicorn has started (its signal handling in place), so
        that whoever is told the server is up may stop it with a signal at once."""
        self._serving.set()

        async def serve():
            serving = asyncio.ensure_future(self._server.serve(sockets=[self.socket]))
            while not self._server.started and not serving.done():
                await asyncio.sleep(0.01)
            if on_ready is not None and self._server.started:
                on_ready()
            await serving

        try:
            asyncio.run(serve())
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serving (from another thread) and wait until `serve_forever` has returned."""
        self._server.should_exit = True
        if self._serving.is_set():
            self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()


def make_server(
    source: RewardSource, host: str = "127.0.0.1", port: int = 8000, max_request_bytes: int = 16 << 20, max_rows: int = 4096,
    verbose: bool = False, workers: int = 8, read_timeout_s: float = 30.0, stuck_after_s: float = 60.0, token: Optional[str] = None,
) -> RewardServer:
    """An HTTP server scoring with `source`, one batch at a time; `port` 0 picks a free port.

    read_timeout_s   a client must deliver each whole request within this time (else it is closed)
    workers          requests handled (parsed, waiting for the source, scored) at once; any more get 503 at once
    stuck_after_s    a scoring call running longer than this makes GET / answer 503 and new POSTs
                     get 503 instead of waiting behind it
    token            when set, a POST needs `Authorization: Bearer <token>` (compared in constant time)
    """
    app = _app(_Scorer(source, max_rows, stuck_after_s), max_request_bytes, workers, token, verbose)
    return RewardServer(app, host, port, read_timeout_s, verbose)


def serve(source: RewardSource, host: str = "127.0.0.1", port: int = 8000, **options) -> None:
    """Serve until interrupted; prints the URL (with the real port when `port` is 0) first."""
    server = make_server(source, host, port, **options)
    if options.get("token") is None and not is_loopback(host):
        print(f"serve-rm: warning: listening on {host} without a token: anyone who can reach this port can use the scorer "
              "(see --token-env)", file=sys.stderr, flush=True)
    try:
        # said once serving (a client, or a test, may stop it with a signal as soon as it reads this)
        url = f"http://{host}:{server.server_address[1]}/"
        server.serve_forever(on_ready=lambda: print(f"serving reward source {source.name} at {url}", flush=True))
    finally:
        server.server_close()
