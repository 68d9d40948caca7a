"""The OpenAI-compatible endpoint an agent program talks to: one server on 127.0.0.1 for a rollout (a starlette app on
uvicorn, ppokit's one HTTP stack), one URL per episode (`http://127.0.0.1:PORT/episodes/KEY/v1`), served in the rollout's
own event loop so that a call is awaited beside the episodes' engine requests (`engines.driver.AsyncRequests`).

    endpoint = Endpoint()
    await endpoint.start()
    base_url = endpoint.open(session)    # session.chat(body) / session.complete(body) -> a response dict (awaitable);
                                         # session.failed(error): a call failed on ppokit's side
    ...                                  # the agent calls base_url + "/chat/completions", "/completions", "/models"
    endpoint.close(base_url)             # later calls: 404 in OpenAI's error format; calls in flight: cancelled
    await endpoint.stop()

What each call means is the session's (`environments.agent_session.AgentSession`); this module only routes, reads JSON and
answers errors as OpenAI does: `{"error": {"message", "type", "param", "code"}}` with the HTTP status. Any API key is
accepted (the URL is the episode's own, on the loopback interface, for the rollout's lifetime only).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
from typing import Any, Optional

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

MODEL_NAME = "ppokit-policy"  # what /v1/models lists; a request may name any model
BODY_LIMIT = 64 * 1024 * 1024  # bytes of one request body (a long conversation with its tools fits)
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]  # every one routed, to answer 404 in OpenAI's form
SHUTDOWN_GRACE_S = 2.0  # at a rollout's end, what a connection still sending a request gets before it is cut


class Refused(Exception):
    """A call answered with an OpenAI error: `status` (400: the request; 404: no such episode or it ended; 413: a body over
    BODY_LIMIT; 500: ppokit's failure), `message`, `param` (the request's key at fault, or None), `kind` (OpenAI's error type)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}.get(status, "server_error")


def error_body(error: Refused) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": None}}


class Endpoint:
    """The server of one rollout's agents (see the module docstring). host: where it listens (the loopback interface)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.port: Optional[int] = None
        self._sessions: dict[str, Any] = {}  # key -> the episode's session, while the episode runs
        self._calls: dict[str, set[asyncio.Task]] = {}  # key -> its calls in flight
        self._server: Optional[uvicorn.Server] = None
        self._serving: Optional[asyncio.Future] = None
        self._listener: Optional[socket.socket] = None

    async def start(self) -> None:
        """Listen on a free loopback port (`port`) and serve from this event loop until `stop`."""
        listener = socket.create_server((self.host, 0))
        self.port = listener.getsockname()[1]
        app = Starlette(routes=[Route("/episodes/{key}/v1/{path:path}", self._handle, methods=METHODS),
                                Route("/{path:path}", self._unknown, methods=METHODS)])
        config = uvicorn.Config(app, http="h11", ws="none", lifespan="off", interface="asgi3", log_config=None, log_level="error",
                                access_log=False, server_header=False, date_header=False, proxy_headers=False,
                                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
        self._server = _Server(config)
        self._serving = asyncio.ensure_future(self._server.serve(sockets=[listener]))
        self._listener = listener
        try:
            while not self._server.started:  # the socket listens already; uvicorn accepts on it once started
                if self._serving.done():
                    self._serving.result()  # its error, if it failed
                    raise RuntimeError("the agents' endpoint stopped before it started")
                await asyncio.sleep(0.001)
        except BaseException:  # its failure, or the rollout stopped meanwhile (Ctrl-C): nothing left serving or open
            self._serving.cancel()
            await asyncio.gather(self._serving, return_exceptions=True)
            self._serving = None
            listener.close()
            raise

    async def stop(self) -> None:
        """Every episode's URL closed (calls in flight cancelled), the server stopped and its socket closed."""
        for key in list(self._sessions):
            self.close_key(key)
        if self._serving is not None:
            self._server.should_exit = True
            try:
                await self._serving
            finally:
                self._serving = None
                self._listener.close()

    def open(self, session) -> str:
        """A new episode's URL (its `base_url`, ending in /v1); `session` answers its calls."""
        key = secrets.token_hex(12)
        self._sessions[key] = session
        self._calls[key] = set()
        return f"http://{self.host}:{self.port}/episodes/{key}/v1"

    def close(self, base_url: str) -> None:
        """The episode has ended: its URL answers 404 from now on, and its calls in flight are cancelled (answered 404)."""
        self.close_key(base_url.rstrip("/").split("/")[-2])

    def close_key(self, key: str) -> None:
        self._sessions.pop(key, None)
        for call in self._calls.pop(key, set()):
            call.cancel()

    # ------------------------------------------------------------------ requests

    async def _unknown(self, request: Request) -> Response:
        return _answer(Refused(404, f"no route {request.method} {request.url.path}; an agent's base_url is "
                                    "http://HOST:PORT/episodes/KEY/v1, given to it by ppokit"))

    async def _handle(self, request: Request) -> Response:
        key, path = request.path_params["key"], request.path_params["path"].rstrip("/")
        session = self._sessions.get(key)
        if session is None:
            return _answer(Refused(404, "this episode has ended (or never was): its URL serves no more calls"))
        route = {("POST", "chat/completions"): session.chat, ("POST", "completions"): session.complete,
                 ("GET", "models"): None}.get((request.method, path))
        if path == "models" and request.method == "GET":
            return _json({"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "ppokit"}]})
        if route is None:
            return _answer(Refused(404, f"{request.method} /v1/{path} is not served here; ppokit serves POST /v1/chat/completions, "
                                        "POST /v1/completions and GET /v1/models"))
        raw = await _body(request)
        if raw is None:
            return _answer(Refused(413, f"the request body is over {BODY_LIMIT} bytes"))
        try:
            body = json.loads(raw or b"null")
        except (ValueError, UnicodeDecodeError) as e:
            return _answer(Refused(400, f"the request body is not JSON ({e})"))
        if not isinstance(body, dict):
            return _answer(Refused(400, "the request body must be a JSON object"))
        call = asyncio.ensure_future(route(body))
        self._calls[key].add(call)
        try:
            return _json(await asyncio.shield(call))
        except Refused as e:
            return _answer(e)
        except Exception as e:  # ppokit's own failure: answered in OpenAI's form, and the rollout stops with it
            session.failed(e)
            return _answer(Refused(500, f"ppokit could not answer this call: {type(e).__name__}: {e}"))
        except asyncio.CancelledError:
            if not call.cancelled():  # the server itself is stopping, or the client went away: the call goes too
                call.cancel()
                raise
            return _answer(Refused(404, "this episode ended while the call was answered"))
        finally:
            self._calls.get(key, set()).discard(call)


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: Ctrl-C and SIGTERM during a rollout are the trainer's."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _body(request: Request) -> Optional[bytes]:
    """The request's body; None when it is over BODY_LIMIT (read no further)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > BODY_LIMIT:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _json(value: dict, status: int = 200) -> Response:
    # json.dumps as is (starlette's JSONResponse refuses NaN and infinities; a logprob answered is never refused)
    return Response(json.dumps(value), status_code=status, media_type="application/json")


def _answer(error: Refused) -> Response:
    return _json(error_body(error), error.status)
