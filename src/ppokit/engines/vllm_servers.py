"""vLLM engines outside the trainer's process (`rollout.placement: separate | servers`): vLLM OpenAI-compatible servers
with vLLM's RL routes, which ppokit reaches over HTTP, and whose weights it pushes through vLLM's weight-transfer API.

- `servers`: the user starts them with vLLM's own CLI on other nodes (docs/rollout.md has the command:
  VLLM_SERVER_DEV_MODE=1 for the RL routes, `--tokens-only` for token ids in and out, `--logprobs-mode
  processed_logprobs`, `--weight-transfer-config '{"backend": "gloo"}'` or nccl) and lists them in `rollout.servers`.
- `separate`: ppokit starts one itself, the same way, in a process of its own (`launch_server`): on a GPU machine on
  devices the trainer does not use, on CPU beside the trainer.

The engine serves the request interface of every engine (`ppokit.engines.base`): requests go to the servers' token
route (`/inference/v1/generate`, many in flight from one event-loop thread), an episode's next turn to the server that
served its last (its prefix cache), others to the least busy. Weights: `sync_weights` pushes the policy to every server
at once through vLLM's trainer-side engine of the backend (`gloo`: `ppokit.engines.weight_transfer`; `nccl`: vLLM's),
labelled with a version (1, 2, ...): every completion says which version sampled it, and one sampled with weights
other than the last pushed is refused (a stale engine). With `rollout.lora_merge: false` (servers on the trainer's machine) the push
sends the base weights once, and every sync after it the policy's adapter alone (`engines.server_adapter`), written to a folder the server reads
(`/v1/load_lora_adapter`, under a new name each time, the one it replaces unloaded) and named by every request; the
version is bumped with `/update_weight_version`. Under torchrun every trainer process holds one of these; the
push is driven by process 0 (the others take part in gathering a sharded policy) once every process's requests have
ended, and every process waits for it.

Every wait is bounded by `rollout.server_timeout_s`: a server that dies or stops answering is one line naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import httpx
import torch
from torch import nn

from ppokit.engines.base import Sampled, EngineLost, Request, Sampling, generate
from ppokit.engines.launched_server import LaunchedServer, free_port
from ppokit.config.fields import differs_from_default
from ppokit.engines.server_adapter import ADAPTER_PREFIX, ServerAdapter, adapter_name
from ppokit.engines.vllm import (VLLMEngine, adapter_rank, check_cpu_head_dim, check_max_model_len, engine_shape, import_vllm, kv_cache_bytes,
                               request_seeds, sampling_kwargs)
from ppokit.engines.weights import architecture, base_weights, policy_weight_metadata, policy_weights, tensor_bytes, unwrap
from ppokit.training.episodes import Episodes
from ppokit.errors import UserError
from ppokit.models.loading import unwrap_peft

GENERATE = "/inference/v1/generate"


def server_url(address: str) -> str:
    """`host:port` (or a URL) -> the base URL."""
    address = address.strip().rstrip("/")
    return address if "://" in address else f"http://{address}"


# ---------------------------------------------------------------------------------------------- HTTP


class Server:
    """One vLLM server: its control plane (health, weights, pause) in plain blocking calls, its token route in
    awaitable ones (`generate`)."""

    def __init__(self, url: str, timeout_s: float):
        self.url = server_url(url)
        self.timeout_s = timeout_s
        self._client = http_client(httpx.Client, timeout_s)

    def __str__(self) -> str:
        return self.url.removeprefix("http://")

    def call(self, method: str, path: str, body: Optional[dict] = None, timeout_s: Optional[float] = None) -> Any:
        """The JSON answer of `method path`; a EngineLost naming this server for anything but a 2xx answer."""
        try:
            answer = self._client.request(method, self.url + path, json=body, timeout=timeout_s or self.timeout_s)
        except httpx.TimeoutException:
            raise EngineLost(f"rollout server {self} did not answer {path} within {timeout_s or self.timeout_s:g} s "
                                     "(rollout.server_timeout_s)") from None
        except httpx.TransportError as e:
            raise EngineLost(f"rollout server {self} cannot be reached ({path}): {_reason(e)}") from None
        if answer.status_code == 404 and "lora_adapter" in path:
            raise EngineLost(f"rollout server {self} has no {path} route: start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                             "(rollout.lora_merge: false; docs/rollout.md)")
        if answer.status_code == 404 and path != "/health":
            raise EngineLost(f"rollout server {self} has no {path} route: start it with VLLM_SERVER_DEV_MODE=1 (vLLM's RL routes) "
                                     "and --tokens-only (docs/rollout.md)")
        if not answer.is_success:
            raise EngineLost(f"rollout server {self} refused {path} (HTTP {answer.status_code}): {_said(answer.text)}")
        if not answer.content:
            return None
        try:
            return answer.json()
        except ValueError:  # a plain-text answer (the LoRA routes': "Success: ...")
            return answer.text

    async def generate(self, client: httpx.AsyncClient, body: dict) -> dict:
        """One request on the token route, on `client` (`http_client(httpx.AsyncClient, ...)`), within timeout_s in
        all -> its JSON answer; a EngineLost naming this server for anything else."""
        try:
            answer = await asyncio.wait_for(client.post(self.url + GENERATE, json=body), self.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            raise EngineLost(f"rollout server {self} did not complete a request within {self.timeout_s:g} s "
                                     "(rollout.server_timeout_s)") from None
        except httpx.TransportError as e:
            raise EngineLost(f"rollout server {self} was lost during a request: {_reason(e)}") from None
        if answer.status_code == 404:
            raise EngineLost(f"rollout server {self} has no {GENERATE} route: start it with --tokens-only (docs/rollout.md)")
        if answer.status_code != 200:
            raise EngineLost(f"rollout server {self} refused a request (HTTP {answer.status_code}): {_said(answer.text)}")
        return answer.json()


def http_client(kind: type, timeout_s: float):
    """An httpx client (`httpx.Client` or `httpx.AsyncClient`) for rollout servers.

    A connection per request: a kept-alive one the server closes when idle (uvicorn: 5 s) while the client sends on it
    fails the request ("Server disconnected"), which requests sent about that far apart (sampling ahead,
    rollout.max_staleness) met. No proxy from the environment (HTTP_PROXY...): the servers are reached directly, as
    the token route always was."""
    return kind(timeout=timeout_s, trust_env=False, limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))


def _reason(error: BaseException) -> str:
    """Why a connection failed, in a few words: the first known cause along the chain (httpx's async connect says
    "All connection attempts failed" over the OSError that says why)."""
    chain, cause = [], error
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    for cause in chain:
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        for known in ("Connection refused", "Remote end closed connection", "Server disconnected", "Connection reset", "Name or service not known"):
            if known in str(cause):
                return known.lower()
    return str(error)[:200] or type(error).__name__


def _said(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:300]
    for key in ("error", "detail", "message"):
        value = body.get(key) if isinstance(body, dict) else None
        if isinstance(value, dict):
            value = value.get("message", value)
        if value:
            return str(value)[:300]
    return text.strip()[:300]


class ServersClient:
    """vLLM's weight-sync control plane (`VLLMWeightSyncClient`) over several servers: every call goes to all of them
    at once (their workers wait for each other in the group), each server's workers numbered after the previous
    server's (`rank_offset`)."""

    def __init__(self, servers: Sequence[Server], world_sizes: Sequence[int]):
        self.servers = list(servers)
        self.offsets = list(itertools.accumulate([0, *world_sizes[:-1]]))

    def _each(self, call: Callable[[int, Server], Any]) -> None:
        with ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
            for future in [pool.submit(call, i, server) for i, server in enumerate(self.servers)]:
                future.result()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._each(lambda i, s: s.call("POST", "/init_weight_transfer_engine",
                                       {"init_info": {**init_info, "rank_offset": init_info["rank_offset"] + self.offsets[i]}}))

    def start_weight_update(self) -> None:
        self._each(lambda i, s: s.call("POST", "/start_weight_update"))

    def update_weights(self, update_info) -> None:
        self._each(lambda i, s: s.call("POST", "/update_weights", {"update_info": update_info}))

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self._each(lambda i, s: s.call("POST", "/finish_weight_update", {"weight_version": weight_version}))

    def update_weight_version(self, version: str) -> None:
        self._each(lambda i, s: s.call("POST", "/update_weight_version", {"new_version": version}))

    def reset_prefix_cache(self) -> None:
        self._each(lambda i, s: s.call("POST", "/reset_prefix_cache"))

    def swap_lora_adapter(self, new: tuple[str, str], old: Optional[str]) -> None:
        """Unload adapter `old` (a name; None: the first of this engine, so every policy adapter the server holds, left by an
        earlier engine or run: their names come again) and load `new` (name, folder) on every server: each holds one."""
        def swap(i, server):
            held = [old] if old is not None else [model["id"] for model in server.call("GET", "/v1/models")["data"]
                                                   if model["id"].startswith(ADAPTER_PREFIX)]
            for name in held:
                server.call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
            server.call("POST", "/v1/load_lora_adapter", {"lora_name": new[0], "lora_path": new[1]})

        self._each(swap)


# ---------------------------------------------------------------------------------------------- separate: a server of ppokit's


def start_separate(base: nn.Module, settings, setup, backend: str, lora_rank: Optional[int] = None) -> tuple[list[str], list[LaunchedServer]]:
    """rollout.placement separate: process 0 of the trainer starts one vLLM server on this node (on GPU on the devices
    its processes here do not use, one engine each) and tells the others where it is -> (addresses, the servers this
    process started)."""
    rank, world = _trainer_ranks()
    if world > int(os.environ.get("LOCAL_WORLD_SIZE", world)):
        raise UserError("rollout.placement: separate starts its vLLM server on the trainer's first node; with several nodes start "
                        "servers yourself and use rollout.placement: servers (docs/rollout.md)")
    said: list[Any] = [None]
    launched: list[LaunchedServer] = []
    if rank == 0:
        try:
            launched = [LaunchedServer(base, *separate_options(base, settings, setup, backend, lora_rank), settings.server_timeout_s)]
            said = [[server.address for server in launched]]
        except UserError as e:
            said = [str(e)]
    if world > 1:
        torch.distributed.broadcast_object_list(said, src=0)
    if isinstance(said[0], str):
        raise UserError(said[0])
    return said[0], launched


def separate_options(base: nn.Module, settings, setup, backend: str, lora_rank: Optional[int] = None) -> tuple[list[str], dict]:
    """(command-line options, environment) of the server `start_separate` starts: what the colocated engine is built
    with (`VLLMEngine`: the shape, the KV cache on CPU), token ids in and out, vLLM's RL routes, the backend; with
    lora_rank (rollout.lora_merge: false) one LoRA adapter of that max_lora_rank, loaded at run time."""
    from vllm.platforms import current_platform

    check_cpu_head_dim(base.config, architecture(base))
    max_model_len, max_num_seqs = engine_shape(settings, setup.longest_sequence, setup.rows_per_rollout, setup.rows_per_forward)
    dtype = next(base.parameters()).dtype
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the trainer's in-process setting is not the server's
    options = ["--tokens-only", "--load-format", "dummy", "--generation-config", "vllm", "--dtype", str(dtype).removeprefix("torch."),
               "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs), "--seed", str(setup.seed),
               "--logprobs-mode", "processed_logprobs", "--weight-transfer-config", json.dumps({"backend": backend}),
               *(["--enforce-eager"] if settings.enforce_eager else [])]
    if lora_rank is not None:  # the current adapter only, as the colocated engine holds it
        options += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "1", "--max-cpu-loras", "1"]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if current_platform.is_cpu():
        options += ["--kv-cache-memory-bytes", str(kv_cache_bytes(base.config, dtype, max_num_seqs, max_model_len))]
        return options, env
    devices = free_devices()
    env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    # The devices are the engine's own: most of their memory by default (a value set in the config is kept).
    share = settings.gpu_memory_utilization if differs_from_default(settings, "gpu_memory_utilization") else SEPARATE_GPU_SHARE
    options += ["--gpu-memory-utilization", str(share), "--data-parallel-size", str(len(devices))]
    return options, env


SEPARATE_GPU_SHARE = 0.9


def free_devices() -> list[str]:
    """The GPUs of this node that the trainer's processes do not use (they take the first LOCAL_WORLD_SIZE), as
    CUDA_VISIBLE_DEVICES names them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
    used = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if len(names) <= used:
        raise UserError(f"rollout.placement: separate needs a GPU the trainer does not use: this node has {len(names)} and the "
                        f"trainer's processes take {used}; run fewer processes, start servers elsewhere (rollout.placement: "
                        "servers), or rollout.placement: colocated")
    return names[used:]


# ---------------------------------------------------------------------------------------------- the engine


class VLLMServersEngine:
    """Rollout engine over vLLM servers (module docstring), built by `VLLMAnyPlacement.create` for rollout.placement separate
    or servers. `connect()` -> (the servers' host:port addresses, the `LaunchedServer`s ppokit started for them): called
    when the engine opens, and again when it is used after `close`."""

    logprobs_are_trainers = False

    def __init__(self, policy: Union[nn.Module, Callable[[], nn.Module]], pad_token_id: int,
                 connect: Callable[[], tuple[list[str], list[LaunchedServer]]], *, backend: str = "gloo",
                 timeout_s: float = 600.0, longest_sequence: int = 0, device: Optional[torch.device] = None,
                 lora_merge: bool = True, lora_rank: Optional[int] = None):
        import_vllm()
        from ppokit.engines.vllm_plugin import register

        register()  # the trainer's side of the gloo backend
        self._policy = policy
        self.pad_token_id = pad_token_id
        self._connect = connect
        self.backend = backend
        self.timeout_s = timeout_s
        self.longest_sequence = longest_sequence
        self.device = device if device is not None else next(unwrap_peft(unwrap(self.policy)).parameters()).device
        self.rank, self.world = _trainer_ranks()
        self.servers: list[Server] = []
        self.launched: list[LaunchedServer] = []
        self.version = 0  # of the weights last pushed (0: none yet)
        self.lora_merge = lora_merge
        # the servers' max_lora_rank at least (lora_rank: as `create` found it for the server it starts)
        self.lora_rank = None if lora_merge else lora_rank if lora_rank is not None else adapter_rank(self.policy)
        self._adapter: Optional[ServerAdapter] = None  # lora_merge false: the adapter's folders, made when the engine opens
        self.last_sync_bytes = 0  # what the last sync_weights sent: pushed, and the adapter's bytes (what the servers read)
        self._transfer = None
        self._session = None
        self._unfinished: dict[str, tuple[int, Future]] = {}  # request id -> (server index, its answer)
        self._where: dict[str, int] = {}  # request id -> the server that served it (an episode's next turn goes there)
        self._done: "queue.Queue[str]" = queue.Queue()
        self._open()

    @classmethod
    def create(cls, setup) -> "VLLMServersEngine":
        """From the trainer's EngineSetup (`rollout.placement` separate or servers; the config checked the keys)."""
        settings = setup.settings
        check_max_model_len(settings.max_model_len, setup.longest_sequence)
        backend = settings.weight_transfer if settings.weight_transfer != "auto" else ("nccl" if setup.device.type == "cuda" else "gloo")
        lora_rank = None if settings.lora_merge else adapter_rank(setup.policy())
        if settings.placement == "servers":
            def connect():
                return list(settings.servers), []
        else:
            def connect():
                return start_separate(unwrap_peft(unwrap(setup.policy())), settings, setup, backend, lora_rank)
        try:
            return cls(setup.policy, setup.pad_token_id, connect, backend=backend, timeout_s=settings.server_timeout_s,
                       longest_sequence=setup.longest_sequence, device=setup.device, lora_merge=settings.lora_merge,
                       lora_rank=lora_rank)
        except EngineLost as e:  # before the run starts: nothing to resume from, the line alone
            raise UserError(f"{e} (rollout.{'servers' if settings.placement == 'servers' else 'placement'})") from None

    def _open(self) -> None:
        """Reach the servers (starting ppokit's own), check them, and push the policy's weights."""
        addresses, self.launched = self._connect()
        self.servers = [Server(address, self.timeout_s) for address in addresses]
        self.max_model_len = sys.maxsize  # the shortest of the servers' (`_check`)
        world_sizes = [self._check(server) for server in self.servers]
        if not self.lora_merge:
            self._adapter = ServerAdapter(self.policy)
        self.client = ServersClient(self.servers, world_sizes)
        self.engine_world = sum(world_sizes)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ppokit-vllm-servers", daemon=True)
        self._thread.start()
        self._session = asyncio.run_coroutine_threadsafe(self._open_session(), self._loop).result(self.timeout_s)
        self.sync_weights(self.policy)

    def _opened(self) -> None:
        if self._session is None:
            self._open()

    @property
    def policy(self) -> nn.Module:
        return self._policy if isinstance(self._policy, nn.Module) else self._policy()

    def _check(self, server: Server) -> int:
        """Server `server` is up, serves the RL routes (VLLM_SERVER_DEV_MODE=1), was started with what ppokit needs, and
        holds sequences of `longest_sequence` tokens -> its world size (workers, data parallel included)."""
        server.call("GET", "/health")
        config = server.call("GET", "/server_info?config_format=json")["vllm_config"]
        model, backend = config["model_config"], (config.get("weight_transfer_config") or {}).get("backend")
        wrong = []
        if model.get("logprobs_mode") != "processed_logprobs":
            wrong.append(f"--logprobs-mode processed_logprobs (it has {model.get('logprobs_mode')}: logprobs of other logits than "
                         "the sampling temperature's)")
        if backend != self.backend:
            wrong.append(f"--weight-transfer-config '{{\"backend\": \"{self.backend}\"}}' (it has {backend or 'none'}; "
                         "rollout.weight_transfer)")
        if self.longest_sequence and model.get("max_model_len", 0) < self.longest_sequence:
            wrong.append(f"--max-model-len {self.longest_sequence} or more (it has {model.get('max_model_len')}: the longest prompt "
                         "+ the tokens after it)")
        lora = config.get("lora_config") or {}
        if self.lora_rank is not None and (lora.get("max_lora_rank") or 0) < self.lora_rank:
            wrong.append(f"--enable-lora --max-lora-rank {self.lora_rank} (rollout.lora_merge: false; it has "
                         f"{'max_lora_rank ' + str(lora['max_lora_rank']) if lora else 'no LoRA'}) and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
        if wrong:
            raise UserError(f"rollout server {server} must be started with {'; '.join(wrong)} (docs/rollout.md)")
        self.max_model_len = min(self.max_model_len, int(model["max_model_len"]))
        return int(server.call("GET", "/get_world_size")["world_size"])

    # ------------------------------------------------------------------ requests

    async def _open_session(self) -> httpx.AsyncClient:
        return http_client(httpx.AsyncClient, self.timeout_s)

    def _wire_id(self, request_id: str) -> str:
        # Request ids are the trainer process's own: several processes may share a server.
        return f"ppokit-{self.rank}-{request_id}"

    def submit(self, requests: Sequence[Request]) -> None:
        """Each request to a server (an episode's next turn to its last's, others to the least busy); a seedless sampled
        one with a seed drawn from torch's generator, all of one call's at once, in order (as `VLLMEngine` draws)."""
        self._opened()
        requests = list(requests)
        for request, seed in zip(requests, request_seeds(requests, self._unfinished, self.max_model_len)):
            index = self._where.get(request.continues) if request.continues is not None else None
            if index is None:
                busy = [0] * len(self.servers)
                for where, _ in self._unfinished.values():
                    busy[where] += 1
                index = min(range(len(self.servers)), key=busy.__getitem__)
            body = {"request_id": self._wire_id(request.request_id), "token_ids": list(request.prompt),
                    "sampling_params": sampling_kwargs(request.sampling, seed)}
            if self._adapter is not None:  # the adapter the servers hold (every trainer process names it alike)
                body["model"] = adapter_name(self.version)
            answer = asyncio.run_coroutine_threadsafe(self.servers[index].generate(self._session, body), self._loop)
            answer.add_done_callback(lambda _, request_id=request.request_id: self._done.put(request_id))
            self._unfinished[request.request_id] = (index, answer)
            if request.keep:
                self._where[request.request_id] = index

    def step(self) -> list[Sampled]:
        """The requests that completed since the last call: waits for at least one (at most rollout.server_timeout_s)."""
        if not self._unfinished:
            return []
        done, deadline = [], time.monotonic() + self.timeout_s
        while not done:
            request_id = next_done(self._done, deadline, self.launched)
            if request_id is None:
                names = sorted({str(self.servers[i]) for i, _ in self._unfinished.values()})
                raise EngineLost(f"rollout server {', '.join(names)} completed no request within {self.timeout_s:g} s "
                                         "(rollout.server_timeout_s)")
            while True:  # what else has completed meanwhile (ids of aborted requests are no longer unfinished)
                if request_id in self._unfinished:
                    done.append(self._completion(request_id, *self._unfinished.pop(request_id)))
                try:
                    request_id = self._done.get_nowait()
                except queue.Empty:
                    break
        return done

    def _completion(self, request_id: str, index: int, answer: Future) -> Sampled:
        try:
            choice = answer.result(timeout=self.timeout_s)["choices"][0]
        except EngineLost as e:
            raise self._lost(index, e) from None
        tokens = list(choice.get("token_ids") or [])
        content = (choice.get("logprobs") or {}).get("content") or []
        versions = {span["version"] for span in choice.get("weight_versions") or []}
        if tokens and choice.get("finish_reason") != "abort" and versions != {str(self.version)}:
            raise EngineLost(f"rollout server {self.servers[index]} sampled request {request_id} with weights of version "
                                     f"{', '.join(sorted(versions)) or 'unknown'}, but version {self.version} was pushed last: "
                                     "its weights are stale")
        return Sampled(request_id, tokens, [float(entry["logprob"]) for entry in content], choice.get("finish_reason") or "abort")

    def _lost(self, index: int, error: EngineLost) -> EngineLost:
        """`error`, with how the server ended when it is one ppokit started and its process is gone."""
        launched = next((s for s in self.launched if s.address == str(self.servers[index])), None)
        died = launched.died() if launched is not None else None
        return EngineLost(f"{error}; {died}") if died else error

    def unfinished(self) -> int:
        return len(self._unfinished)

    def abort(self, request_ids: Iterable[str]) -> list[Sampled]:
        """Stop them (vLLM's /abort_requests on the servers that hold them) -> their tokens so far."""
        wanted = [i for i in dict.fromkeys(request_ids) if i in self._unfinished]
        by_server: dict[int, list[str]] = {}
        for request_id in wanted:
            by_server.setdefault(self._unfinished[request_id][0], []).append(self._wire_id(request_id))
        for index, ids in by_server.items():
            self.servers[index].call("POST", "/abort_requests", {"request_ids": ids})
        return [self._completion(i, *self._unfinished.pop(i)) for i in wanted]

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._where.pop(request_id, None)

    def serving(self):
        return contextlib.nullcontext()

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> Episodes:
        """One response per prompt -> Episodes: seedless requests of one call (`engines.base.generate`)."""
        return generate(self, prompts, sampling, self.pad_token_id, self.device)

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def sync_weights(self, policy: nn.Module) -> None:
        """Push the policy's weights to every server, labelled version + 1 (module docstring); every trainer process
        calls it, process 0 sends, all of them wait until the servers hold the new version."""
        self._opened()
        if self._unfinished:
            raise RuntimeError("rollout engine: weights pushed while requests are in flight")
        if self.world > 1:
            # The servers are shared: every trainer process's requests end before the push starts (vLLM's engine core
            # steps between the pieces of a push; a request running then meets half-loaded weights).
            torch.distributed.barrier()
        pushed = self._transfer is None or self._adapter is None  # with the adapter alone the base weights go once
        if self._transfer is None:
            self._transfer = self._open_transfer()
        self.version += 1
        self.last_sync_bytes = self._push() if pushed else 0
        if self._adapter is not None:
            self.last_sync_bytes += self._adapter.send(self.policy, self.version, self.client, self.rank)
            if not pushed and self.rank == 0:
                self.client.update_weight_version(str(self.version))
        if self.rank == 0:
            # Their prefix caches hold keys and values computed with the old weights.
            self.client.reset_prefix_cache()
        if self.world > 1:
            torch.distributed.barrier()

    def _push(self) -> int:
        """The weights through the weight transfer, labelled with this version -> the bytes pushed."""
        if self.backend == "gloo":
            self._transfer.send_weights(str(self.version))
        else:  # vLLM's trainer engines take no version: it is set after the push
            self._transfer.send_weights()
            if self.rank == 0:
                self.client.update_weight_version(str(self.version))
        return sum(tensor_bytes(shape, dtype) for _, dtype, shape in policy_weight_metadata(self.policy))

    def _open_transfer(self):
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from ppokit.engines.weight_transfer import GlooTrainerInitInfo, PolicySource, address_towards

        source = PolicySource(lambda: self.policy, policy_weights if self._adapter is None else base_weights)
        first = self.servers[0].url.removeprefix("http://").rsplit(":", 1)
        if self.backend == "gloo":
            info = GlooTrainerInitInfo(master_address=address_towards(first[0], int(first[1])), world_size=1 + self.engine_world,
                                       timeout_s=self.timeout_s, rank=self.rank)
        else:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(master_address=address_towards(first[0], int(first[1])), master_port=free_port(),
                                       world_size=1 + self.engine_world, rank=self.rank)
        return WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=source)

    def release(self) -> None:
        """Nothing to free: the engines hold memory of their own, not the trainer's."""

    def resume(self) -> None:
        pass

    def close(self) -> None:
        """Abort what is in flight, leave the weight-transfer group, stop the servers ppokit started (their output kept
        when one had died: an error named it). A later request or push opens the engine again."""
        if self._session is None:
            return
        if self._unfinished:
            with contextlib.suppress(EngineLost):
                self.abort(list(self._unfinished))
            self._unfinished.clear()
        self._where.clear()
        if self._transfer is not None:
            self._transfer.shutdown()
            self._transfer = None
        self.version = 0
        if self._adapter is not None:
            self._adapter.close()
            self._adapter = None
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._session.aclose(), self._loop).result(10)
        self._session = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        for server in self.launched:
            server.stop()
        self.launched = []


WATCH_S = 1.0  # how often a wait looks at the servers ppokit started


def next_done(done: "queue.Queue[str]", deadline: float, launched: Sequence[LaunchedServer]) -> Optional[str]:
    """The next request id put in `done`, waited for until `deadline` (time.monotonic; None once it passed). Every
    WATCH_S the servers ppokit started are looked at: one that lost a process (vLLM's API server stays up, and silent,
    when its engine core is killed) is EngineLost at once, not after rollout.server_timeout_s."""
    while True:
        try:
            return done.get(timeout=max(0.0, min(WATCH_S, deadline - time.monotonic())))
        except queue.Empty:
            pass
        for server in launched:
            said = server.died()
            if said is not None:
                raise EngineLost(f"rollout server {server.address} stopped serving: {said}")
        if time.monotonic() >= deadline:
            return None


def _trainer_ranks() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class VLLMAnyPlacement(VLLMEngine):
    """`rollout.engine: vllm` where `rollout.placement` puts it: in the trainer's process (`VLLMEngine`), or in vLLM
    servers (`VLLMServersEngine`). Its checks, memory and installation are VLLMEngine's, which count every placement."""

    @classmethod
    def create(cls, setup) -> Union[VLLMEngine, VLLMServersEngine]:
        engine = VLLMEngine if setup.settings.placement == "colocated" else VLLMServersEngine
        return engine.create(setup)
