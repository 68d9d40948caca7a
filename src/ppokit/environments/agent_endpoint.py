"""The OpenAI-compatible endpoint an agent program talks to: one aiohttp server on 127.0.0.1 for a rollout, one URL per
episode (`http://127.0.0.1:PORT/episodes/KEY/v1`), served in the rollout's own event loop so that a call is awaited
beside the episodes' engine requests (`engines.driver.AsyncRequests`).

    endpoint = Endpoint()
    await endpoint.start()
    base_url = endpoint.open(session)    # session.chat(body) / session.complete(body) -> a response dict (awaitable);
                                         # session.failed(error): a call failed on ppokit's side
    ...                                  # the agent calls base_url + "/chat/completions", "/completions", "/models"
    endpoint.close(base_url)             # later calls: 404 in OpenAI's error format; calls in flight: cancelled
    await endpoint.stop()

What each call means is the session's (`environments.agent.AgentSession`); this module only routes, reads JSON and
answers errors as OpenAI does: `{"error": {"message", "type", "param", "code"}}` with the HTTP status. Any API key is
accepted (the URL is the episode's own, on the loopback interface, for the rollout's lifetime only).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any, Optional

MODEL_NAME = "ppokit-policy"  # what /v1/models lists; a request may name any model
BODY_LIMIT = 64 * 1024 * 1024  # bytes of one request body (a long conversation with its tools fits)


class Refused(Exception):
    """A call answered with an OpenAI error: `status` (400: the request; 404: no such episode or it ended; 500: ppokit's
    failure), `message`, `param` (the request's key at fault, or None), `kind` (OpenAI's error type)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "invalid_request_error", 404: "not_found_error"}.get(status, "server_error")


def error_body(error: Refused) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": None}}


class Endpoint:
    """The server of one rollout's agents (see the module docstring). host: where it listens (the loopback interface)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.port: Optional[int] = None
        self._sessions: dict[str, Any] = {}  # key -> the episode's session, while the episode runs
        self._calls: dict[str, set[asyncio.Task]] = {}  # key -> its calls in flight
        self._runner = None

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=BODY_LIMIT)
        app.router.add_route("*", "/episodes/{key}/v1/{path:.*}", self._handle)
        app.router.add_route("*", "/{path:.*}", self._unknown)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for key in list(self._sessions):
            self.close_key(key)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

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

    async def _unknown(self, request):
        return _answer(Refused(404, f"no route {request.method} {request.path}; an agent's base_url is "
                                    "http://HOST:PORT/episodes/KEY/v1, given to it by ppokit"))

    async def _handle(self, request):
        key, path = request.match_info["key"], request.match_info["path"].rstrip("/")
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
        try:
            body = json.loads(await request.read() or b"null")
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


def _json(value: dict):
    from aiohttp import web

    return web.json_response(value)


def _answer(error: Refused):
    from aiohttp import web

    return web.json_response(error_body(error), status=error.status)
