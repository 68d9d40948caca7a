"""A gloo weight-transfer backend for vLLM's RL API: the trainer's weights moved over TCP to vLLM engines in
other processes or on other nodes, the way vLLM's `nccl` backend moves them between GPUs.

vLLM's RL API (`LLM.init_weight_transfer_engine / start_weight_update / update_weights / finish_weight_update`,
and the same as a server's routes) hands the data plane to a backend registered in
`WeightTransferEngineFactory` (inside vLLM's worker) and `WeightTransferTrainerFactory` (in the trainer). Its
own backends (nccl, ipc, ...) need CUDA; on CPU every one of them fails (docs/rollout.md: what was measured).
This module adds `gloo`, registered by `ppokit.engines.vllm_plugin.register`: a `vllm.general_plugins` entry point of
ppokit's (pyproject.toml), which vLLM loads in each of its processes (API server, engine core, workers), so a server
started with vLLM's own CLI (`--weight-transfer-config '{"backend": "gloo"}'`) serves it where ppokit is
installed.

The group: the trainer's sender (its rank 0) is gloo rank 0 and hosts the rendezvous (a TCPStore on
`master_address`, a free port); the engines' workers are ranks `rank_offset + worker rank` (one server's workers
after another's). One push (`GlooTrainerWeightTransferEngine.send_weights`):
  1. the sender calls start_weight_update on every engine (vLLM's layer-wise reload begins: each layer is
     reprocessed once all its tensors have arrived);
  2. it announces the tensors (names, dtypes, shapes) with update_weights, which the workers serve while
  3. the sender broadcasts them in buckets of at most `bucket_bytes` (a tensor larger than that alone), each
     packed into one byte buffer: a push holds one bucket at a time on either side, besides vLLM's own
     buffering of a layer until it is complete (tensors come in module order, so that is one layer);
  4. finish_weight_update(version) ends it and labels the weights: every completion vLLM hands back after it
     carries that version (its `weight_versions`).
Every wait is bounded: the group's operations by `timeout_s`, the control calls by the client's own timeout.
"""

from __future__ import annotations

import datetime
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import ClassVar, Iterator, Optional

import torch
import torch.distributed as dist

from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ppokit.engines.vllm_plugin import BACKEND
from ppokit.engines.weights import PUSH_BUCKET_BYTES as DEFAULT_BUCKET_BYTES
from ppokit.engines.weights import bucket_bounds, policy_weight_metadata, policy_weights, tensor_bytes

DEFAULT_TIMEOUT_S = 300.0
STORE_PREFIX = "ppokit-weight-transfer"


def address_towards(host: str, port: int = 9) -> str:
    """This machine's address on the route to `host` (no packet is sent): what a peer there can reach us at."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((socket.gethostbyname(host), port))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _gloo_group(store, rank: int, world_size: int, timeout_s: float, local_address: str):
    """A gloo process group of its own (not torch.distributed's default group, which a trainer under torchrun
    owns), its connections made on `local_address` (not whatever the hostname resolves to)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address)]
    return dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), rank, world_size, options)


def _broadcast(group, buffer: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()


# ---------------------------------------------------------------------------------------------- engine side


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """What a vLLM worker is told at `init_weight_transfer_engine` (a JSON dict over HTTP)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One push's tensors, in the order they are broadcast."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Inside vLLM's worker: receives a push's buckets and loads them with vLLM's layer-wise reload."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        store = dist.TCPStore(init_info.master_address, init_info.master_port, init_info.world_size, False,
                              timeout=datetime.timedelta(seconds=init_info.timeout_s))
        self.group = _gloo_group(store, rank, init_info.world_size, init_info.timeout_s,
                                 address_towards(init_info.master_address, init_info.master_port))
        self.bucket_bytes = init_info.bucket_bytes

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # In place of the base class's, which ends with torch.accelerator.synchronize(): that raises where there is
        # no accelerator (vLLM's CPU build), and gloo's broadcasts have completed when they return.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer: init_weight_transfer_engine was not called")
        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        sizes = [tensor_bytes(shape, dtype) for shape, dtype in zip(update_info.shapes, dtypes)]
        for bucket in bucket_bounds(sizes, self.bucket_bytes):
            # A fresh buffer per bucket: vLLM's layer-wise reload keeps a layer's tensors (views of it) until the
            # layer is complete.
            buffer = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8)
            _broadcast(self.group, buffer)
            pieces = buffer.split([sizes[i] for i in bucket])
            self.model.load_weights([(update_info.names[i], piece.view(dtypes[i]).view(update_info.shapes[i]))
                                     for i, piece in zip(bucket, pieces)])

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from ppokit.engines.vllm_worker import reprocess_kept_weights

        finalize_layerwise_reload(self.model, self.model_config)
        reprocess_kept_weights(self.model)

    def shutdown(self) -> None:
        self.group = None


# ---------------------------------------------------------------------------------------------- trainer side


class PolicySource(WeightSource):
    """The policy's weights as vLLM's trainer engines read them (`ppokit.engines.weights`: a LoRA policy merged, a
    sharded one gathered a tensor at a time, a tied weight once). `policy()` is asked at every push: the trainer's
    wrapping may change it. weights: `policy_weights`, or `base_weights` (the adapted layers unmerged, for an engine
    that serves the adapter as a LoRA: same names, shapes and dtypes)."""

    def __init__(self, policy, weights=policy_weights):
        self.policy = policy
        self.weights = weights

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, dtype, shape) for name, dtype, shape in policy_weight_metadata(self.policy())]

    def __iter__(self):
        return self.weights(self.policy())


class OfflineClient:
    """The control calls `GlooTrainerWeightTransferEngine` makes, over an `LLM` in this process (vLLM's offline RL
    methods) instead of a server's routes (`vllm_servers.ServersClient`): a push into an engine the caller built."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: Optional[int] = None) -> None:
        self.llm.finish_weight_update(weight_version)


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of the group. master_address: where the engines reach the sender (`address_towards` one
    of them); master_port 0: a free one. world_size: 1 + every engine worker. rank (keyword): this trainer
    process's rank; only rank 0 sends."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    world_size: int
    master_port: int = 0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """In the trainer: pushes `source`'s weights to every engine of the group. Called on every trainer rank (a
    sharded policy's tensors are gathered by all of them); only the sender touches the engines."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source: WeightSource, is_sender: bool, bucket_bytes: int, timeout_s: float):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.group = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source: Optional[WeightSource] = None):
        if source is None:
            raise ValueError("gloo weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     bucket_bytes=init_info.bucket_bytes, timeout_s=init_info.timeout_s)
        if not engine.is_sender:
            return engine
        store = dist.TCPStore(init_info.master_address, init_info.master_port, init_info.world_size, True,
                              timeout=datetime.timedelta(seconds=init_info.timeout_s), wait_for_workers=False)
        worker_info = GlooInitInfo(master_address=init_info.master_address, master_port=store.port, rank_offset=1,
                                   world_size=init_info.world_size, bucket_bytes=init_info.bucket_bytes,
                                   timeout_s=init_info.timeout_s)
        # The workers wait inside init_weight_transfer_engine for the group to form: both sides at once.
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            try:
                engine.group = _gloo_group(store, 0, init_info.world_size, init_info.timeout_s, init_info.master_address)
            except Exception:
                if joined.done():
                    joined.result()  # the engines' refusal says more than the group's timeout
                raise
            joined.result()
        engine.store = store  # the rendezvous lives as long as the group
        return engine

    def send_weights(self, weight_version: Optional[str] = None) -> None:
        """One push (module docstring), labelled `weight_version` on the engines."""
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:  # a sharded policy's gathers are collectives of every trainer rank
                pass
            return
        update = GlooUpdateInfo(names=[m.name for m in meta], dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                                shapes=[list(m.shape) for m in meta])
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.update_weights, asdict(update))
            self._broadcast_buckets(meta, iter(self.source), received)
            received.result()
        finally:
            # Never wait for the engines' call here: after a failed broadcast they may never answer (their group
            # times out after timeout_s; the client's own timeout ends the call).
            pool.shutdown(wait=False)
        self.client.finish_weight_update(weight_version)

    def _broadcast_buckets(self, meta: list[ParamMeta], pairs: Iterator, received) -> None:
        sizes = [tensor_bytes(m.shape, m.dtype) for m in meta]
        for bucket in bucket_bounds(sizes, self.bucket_bytes):
            if received.done():
                received.result()  # the engines refused the push: say why instead of waiting on the group
            tensors = []
            for i in bucket:
                pair = next(pairs, None)
                if pair is None:
                    raise ValueError(f"gloo weight transfer: the weights ended before {meta[i].name}, which their metadata announced")
                name, tensor = pair
                if name != meta[i].name or tensor.dtype != meta[i].dtype or tuple(tensor.shape) != tuple(meta[i].shape):
                    raise ValueError(f"gloo weight transfer: the weights yielded {name} {tensor.dtype} {tuple(tensor.shape)} "
                                     f"where their metadata said {meta[i].name} {meta[i].dtype} {tuple(meta[i].shape)}")
                tensors.append(tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8))
            buffer = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
            del tensors
            _broadcast(self.group, buffer)
        extra = next(pairs, None)
        if extra is not None:
            raise ValueError(f"gloo weight transfer: the weights yielded {extra[0]} beyond their metadata")

    def shutdown(self) -> None:
        self.group = None
        self.store = None
