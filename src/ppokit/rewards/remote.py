"""Rewards over HTTP: a client source and `ppokit serve-rm`, which serves any source.

The protocol, one POST per batch of rows:
    request   {"prompts": [str], "completions": [str], "columns": {name: [value per row]}}
    response  {"rewards": [number or null per row]}       (null: no score for that row)
    errors    HTTP 4xx/5xx with {"error": "message"}; 422 means the source failed on this data.
Connection errors, timeouts, 429 and 5xx are retried with exponential back-off; after the last
retry the run stops with the last error. A missing or non-finite score is never read as 0.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from ppokit.errors import UserError
from ppokit.rewards.sources import RewardError, RewardSource, ScoringBatch, check_scores

MAX_BACKOFF_S = 30.0


@dataclass
class RemoteReward:
    """A reward source behind HTTP (the `reward.remote` section)."""

    url: str
    timeout_s: float = 60.0
    max_retries: int = 3
    backoff_s: float = 1.0
    batch_size: int = 64
    headers: dict = field(default_factory=dict)
    name: str = "remote"

    def score(self, batch: ScoringBatch) -> torch.Tensor:
        n = len(batch)
        return torch.cat([self._post(batch.select(list(range(i, min(i + self.batch_size, n))))) for i in range(0, n, self.batch_size)])

    def _post(self, batch: ScoringBatch) -> torch.Tensor:
        body = json.dumps(
            {"prompts": batch.prompts, "completions": batch.completions, "columns": batch.columns}, default=str
        ).encode()
        headers = {"Content-Type": "application/json", **{k: os.path.expandvars(str(v)) for k, v in self.headers.items()}}
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    payload = response.read()
            except urllib.error.HTTPError as e:
                detail = _error_detail(e)
                if e.code == 429 or e.code >= 500:
                    last_error = f"HTTP {e.code}: {detail}"
                    continue
                if e.code == 422:
                    raise RewardError(f"remote reward {self.name} ({self.url}) failed on this batch: {detail}; first {batch.describe_row(0)}") from None
                raise UserError(f"remote reward {self.name}: {self.url} answered HTTP {e.code}: {detail}") from None
            except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
                last_error = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
                continue
            return self._parse(payload, batch)
        raise UserError(
            f"remote reward {self.name}: POST {self.url} failed {self.max_retries + 1} time(s) "
            f"(timeout {self.timeout_s:g}s, reward.remote.max_retries={self.max_retries}); last error: {last_error}"
        )

    def _parse(self, payload: bytes, batch: ScoringBatch) -> torch.Tensor:
        try:
            data = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            raise RewardError(f"remote reward {self.name} ({self.url}) answered something that is not JSON: {payload[:200]!r}") from None
        if not isinstance(data, dict) or not isinstance(data.get("rewards"), list):
            raise RewardError(f"remote reward {self.name} ({self.url}) answered {str(data)[:200]}; expected {{\"rewards\": [...]}}")
        return check_scores(data["rewards"], batch, self.name, what="remote reward")


def _error_detail(error: urllib.error.HTTPError) -> str:
    try:
        body = error.read()
        return str(json.loads(body).get("error", body[:300]))
    except Exception:
        return str(error.reason)


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
    return ScoringBatch(prompts, completions, columns)


def make_server(
    source: RewardSource, host: str = "127.0.0.1", port: int = 8000, max_request_bytes: int = 16 << 20, max_rows: int = 4096,
    verbose: bool = False,
) -> ThreadingHTTPServer:
    """An HTTP server scoring with `source` (one request at a time); `port` 0 picks a free port."""
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._reply(200, {"status": "ok", "source": source.name})

        def do_POST(self):
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                self.close_connection = True
                return self._reply(411, {"error": "a Content-Length header is required"})
            if int(length) > max_request_bytes:
                self.close_connection = True
                return self._reply(413, {"error": f"request of {length} bytes; at most {max_request_bytes}"})
            try:
                batch = _request_batch(json.loads(self.rfile.read(int(length))), max_rows)
            except ValueError as e:  # JSONDecodeError included
                return self._reply(400, {"error": f"bad request: {e}"})
            try:
                with lock:
                    scores = source.score(batch) if len(batch) else torch.zeros(0)
            except UserError as e:
                return self._reply(422, {"error": str(e)})
            except Exception as e:
                return self._reply(500, {"error": f"{type(e).__name__}: {e}"})
            self._reply(200, {"rewards": [v if math.isfinite(v) else None for v in scores.tolist()]})

        def log_message(self, format, *args):
            if verbose:
                sys.stderr.write(f"serve-rm: {self.address_string()} {format % args}\n")

    return ThreadingHTTPServer((host, port), Handler)


def serve(source: RewardSource, host: str = "127.0.0.1", port: int = 8000, **limits) -> None:
    """Serve until interrupted; prints the URL (with the real port when `port` is 0) first."""
    server = make_server(source, host, port, **limits)
    print(f"serving reward source {source.name} at http://{host}:{server.server_address[1]}/", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
