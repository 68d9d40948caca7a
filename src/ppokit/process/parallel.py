"""Several processes: how the models are spread over them, and the few things that changes.

`parallel.strategy` picks one of two strategies, both built by `strategy(settings, accelerator)`:

- `ddp` (Replicated, the default): every process holds every model whole; accelerate wraps the
  trainable module in DistributedDataParallel, which averages gradients after backward. With one
  process nothing is wrapped.
- `fsdp` (Sharded): PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) splits the weights,
  gradients and optimiser state of the trainable roles 1/N per process, and the frozen roles'
  weights too (`parallel.shard_frozen`). The unit of all-gather is one decoder layer: before a
  layer runs its weights are gathered, after it they are freed again. The rest of a model
  (embeddings, final norm, head) is one more unit. With one process nothing is split, but the
  same code runs (CPU offload, bf16 through `MixedPrecisionPolicy`, sharded checkpoints).

What the trainer asks of a strategy, each in one method:

    prepare(model, build)            wrap the trainable module; build(model) -> (optimiser, schedule)
                                     over the parameters it then holds
    place_frozen(model)              a reference or reward model on the device (sharded or whole)
    generation(policy)               context for sampling: under fsdp, gather the policy once for the
                                     whole rollout instead of once per layer per decoded token
    no_sync(model, last)             context for one micro-batch's backward
    clip_grad_norm_(model, max_norm) the global gradient norm, clipped (max_norm 0: not clipped)
    consolidated(model)              context yielding, on the main process, a plain module with
                                     every full weight (for save_pretrained); None elsewhere
    checkpoint_weights()             how a checkpoint holds weights and optimiser state: None for
                                     the plain files of ppokit.run.checkpoint (its default; this module
                                     does not import it), or ShardedWeights (DCP, every process
                                     writes its shards)

And, strategy or not, `stop_together(accelerator)`: a failure on one process (a reward error) shared,
so that every process stops at the same point with the same error instead of waiting for it.

Memory under fsdp, N processes, a policy of P parameters in b bytes each, trained with AdamW:
weights + gradients + optimiser state take about (b + b + 8) P / N per process, against
(b + b + 8) P under ddp. Sampling with `parallel.unshard_for_generation: true` (the default)
holds the whole policy, b P, on every process for the length of the rollout, plus the KV cache;
`false` holds one layer at a time but all-gathers every layer at every decoded token.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from pathlib import Path
from typing import Callable, Optional, Protocol, Sequence

import torch
from torch import nn

from ppokit.errors import UserError
from ppokit.process.strategies import STRATEGIES

SHARDED_DIR = "sharded"  # the DCP folder inside a checkpoint written under fsdp


Build = Callable[[nn.Module], tuple]  # model -> (optimizer, scheduler)


class Strategy(Protocol):
    strategy: str
    accelerator: object
    backward_separately: bool  # see `backward_separately`
    uneven_forwards: bool  # processes may run different numbers of forward passes (an agent's segment rows: experience.with_scores)

    def prepare(self, model: nn.Module, build: Build) -> tuple: ...
    def place_frozen(self, model: nn.Module) -> nn.Module: ...
    def generation(self, policy: nn.Module) -> contextlib.AbstractContextManager: ...
    def no_sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager: ...
    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor: ...
    def consolidated(self, model: nn.Module) -> contextlib.AbstractContextManager: ...
    def checkpoint_weights(self): ...


def backward_separately(processes: int) -> bool:
    """Whether training back-propagates a micro-batch's policy terms before the critic's forward
    (`optimise.micro_batch_backward`), so that the two models' activations are never alive together:
    the same gradients, the larger of the two models' activations instead of their sum (`ppokit plan`
    counts it so). On one process. DDP wants one backward per forward of the module it wraps, so under
    ddp with several processes both models run one forward and one backward together (fsdp with
    several processes does the same: not tried the other way)."""
    return processes == 1


def strategy(settings, accelerator, bf16: bool = False) -> "Replicated | Sharded":
    """The strategy `settings` (a ParallelConfig) asks for, on `accelerator`'s processes (its class: ppokit.process.strategies)."""
    facts = STRATEGIES.get(settings.strategy)
    if facts is None:
        raise UserError(f"parallel.strategy: unknown strategy {settings.strategy!r}; use one of {', '.join(STRATEGIES)}")
    return globals()[facts.implementation](accelerator, settings, bf16=bf16)


def make_accelerator(settings, precision: str):
    """The run's accelerate.Accelerator for the `parallel:` section `settings` and mixed precision `precision` (no, fp16,
    bf16: `roles.mixed_precision`), once the launcher's environment is checked (one line, not accelerate's traceback)
    and this process follows its launcher (before the rendezvous, which waits for a launcher that may be gone)."""
    from accelerate import Accelerator

    from ppokit.process import launcher

    launcher.check_launch()
    launcher.follow_launcher()
    accelerator = Accelerator(mixed_precision=accelerator_mixed_precision(settings, precision))
    launcher.check_world_size(accelerator.num_processes)
    return accelerator


def sum_over_processes(accelerator) -> Callable[[torch.Tensor], torch.Tensor]:
    """tensor -> its sum over every process, on the tensor's own device (with one process the tensor itself)."""
    if accelerator.num_processes == 1:
        return lambda tensor: tensor
    return lambda tensor: accelerator.reduce(tensor.to(accelerator.device), reduction="sum").to(tensor.device)


def accelerator_mixed_precision(settings, precision: str) -> str:
    """accelerate's mixed precision for the strategy: under one with its own policy (fsdp: FSDP's
    MixedPrecisionPolicy) bf16 is that policy, so accelerate must not add autocast on top of it."""
    return "no" if STRATEGIES[settings.strategy].own_mixed_precision else precision


class EveryProcessStops(UserError):
    """A user error that every process raises at the same point (`stop_together`): they stop together,
    so the run can still write a checkpoint, which needs all of them, on its way out."""

    def before_exit(self) -> None:
        # A launcher such as torchrun ends the other processes as soon as one exits non-zero: none may
        # leave before every one has finished stopping (the main process commits the checkpoint, unlocks).
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()


def stop_together(accelerator) -> Optional[Callable[[Optional[UserError]], None]]:
    """With several processes: verdict(error or None), which every process calls at the same point of a
    step that can fail on some of them alone (a reward source under reward.on_error=raise). If none
    failed it returns; else every process raises the same EveryProcessStops, "process R: <R's error>",
    R the first process that failed. One all-reduce of a flag per call; the message travels only on
    failure. Without it the processes that did not fail would wait in their next collective for one
    that has stopped. None with one process: its errors need no sharing."""
    if accelerator.num_processes == 1:
        return None

    def verdict(error: Optional[UserError]) -> None:
        world, rank = accelerator.num_processes, accelerator.process_index
        flag = torch.tensor([float(world - rank if error is not None else 0)], device=accelerator.device)
        first = world - int(accelerator.reduce(flag, "max").item())  # the lowest rank that failed
        if first == world:
            return
        message = [str(error) if rank == first else None]
        torch.distributed.broadcast_object_list(message, src=first)
        raise EveryProcessStops(f"process {first}: {message[0]}") from (error if rank == first else None)

    return verdict


SHARED_MARKER = ".ppokit-shared"  # written by the main process at the start of a run of several processes, then removed


def check_shared_folder(folder: Path, accelerator) -> None:
    """With several processes: every process sees the run folder the main process writes in, at that
    process's own path to it (`folder`) and at the main process's (where the others write their shards of a
    checkpoint). Nodes whose output_dir is not one shared folder would each write their part of every
    checkpoint somewhere else. The main process writes a random token into the folder; every process reads
    it back; if one cannot, every process stops with the same one line (`stop_together`)."""
    if accelerator.num_processes == 1:
        return
    import secrets
    import socket

    main = accelerator.is_main_process
    marker = Path(folder) / SHARED_MARKER
    if main:
        marker.write_text(secrets.token_hex(16))
    sent = [marker.read_text() if main else None, str(Path(folder).resolve()) if main else None]
    torch.distributed.broadcast_object_list(sent, src=0)
    token, main_folder = sent
    unseen = []
    for path in dict.fromkeys([Path(folder), Path(main_folder)]):
        try:
            if (path / SHARED_MARKER).read_text() != token:
                unseen.append(path)
        except OSError:
            unseen.append(path)
    error = None if not unseen else UserError(
        f"output_dir: this process (on {socket.gethostname()}) does not see the run folder {main_folder} that process 0 "
        f"writes in{f', at {unseen[0]} (its output_dir)' if unseen[0] != Path(main_folder) else ''}; every process of a run "
        "must see one folder: give every node the same output_dir, on a file system they share")
    try:
        stop_together(accelerator)(error)
    finally:
        if main:
            marker.unlink(missing_ok=True)


# gloo's words when the process at the other end of a connection has gone (killed, crashed)
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def lost_process(error: BaseException, accelerator, last_checkpoint: Optional[Path]) -> Optional[UserError]:
    """One line for a collective that failed because another process of the run ended (SIGKILL, a crash):
    which process, and the checkpoint to resume from; None when `error` is something else."""
    text = str(error)
    if accelerator.num_processes == 1 or not isinstance(error, RuntimeError) or not any(p in text for p in _PEER_GONE):
        return None
    others = [r for r in range(accelerator.num_processes) if r != accelerator.process_index]
    who = f"process {others[0]}" if len(others) == 1 else "another process"
    said = next(p for p in _PEER_GONE if p in text)
    last = f"the last complete checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint of this run was written yet"
    return UserError(f"{who} of the run ended while process {accelerator.process_index} waited for it ({said}); {last}: "
                     "see that process's output for why, and continue with --resume")


# --------------------------------------------------------------------------- ddp


class Replicated:
    """Whole models on every process; DistributedDataParallel (through accelerate) when there are several."""

    strategy = "ddp"
    uneven_forwards = True  # processes may run different numbers of forwards (a forward is no collective): an agent's segment rows

    def __init__(self, accelerator, settings=None, bf16: bool = False):
        self.accelerator = accelerator
        self.backward_separately = backward_separately(accelerator.num_processes)

    def prepare(self, model, build):
        # The schedule stays outside accelerate: its wrapper steps a schedule once per process per call.
        optimizer, scheduler = build(model)
        model, optimizer = self.accelerator.prepare(model, optimizer)
        if self.accelerator.num_processes == 1 and isinstance(model, nn.parallel.DistributedDataParallel):
            # torchrun with one process: accelerate wraps DDP all the same, which has no one to average with and
            # would hold training to one forward and one backward per step (see `backward_separately`).
            model = model.module
        return model, optimizer, scheduler

    def place_frozen(self, model):
        return model.to(self.accelerator.device)

    def generation(self, policy):
        return contextlib.nullcontext()

    def no_sync(self, model, last):
        # Gradients are averaged over processes once, after the last micro-batch of an optimiser step.
        return contextlib.nullcontext() if last else self.accelerator.no_sync(model)

    def clip_grad_norm_(self, model, max_norm):
        if max_norm > 0:
            return self.accelerator.clip_grad_norm_(model.parameters(), max_norm)
        return gradient_norm(model.parameters())

    @contextlib.contextmanager
    def consolidated(self, model):
        yield self.accelerator.unwrap_model(model) if self.accelerator.is_main_process else None

    def checkpoint_weights(self):
        return None  # TrainedParts' default: ppokit.run.checkpoint.PlainWeights


# --------------------------------------------------------------------------- fsdp


def _fsdp():
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    except ImportError:
        raise UserError(
            f"parallel.strategy: fsdp needs PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6); "
            f"this is torch {torch.__version__}"
        ) from None
    return fully_shard, FSDPModule, MixedPrecisionPolicy, CPUOffloadPolicy, OffloadPolicy


def _process_group(accelerator) -> None:
    """One process is launched without a process group; FSDP needs one (of size 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    if accelerator.num_processes > 1:
        raise UserError("parallel.strategy: fsdp with several processes needs torch.distributed initialised (launch with torchrun or accelerate launch)")
    backend = "nccl" if accelerator.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def decoder_layers(model: nn.Module, class_names: Sequence[str] = ()) -> list[nn.Module]:
    """The modules FSDP shards one by one: instances of `class_names`, by default the classes in the
    model's `_no_split_modules` (transformers' list of blocks that must stay whole: its decoder layers).
    Innermost first, so that nested matches are sharded bottom-up as FSDP requires."""
    from ppokit.models.loading import unwrap_peft

    base = unwrap_peft(model)
    names = set(class_names) or set(getattr(base, "_no_split_modules", None) or ())
    found = [m for m in base.modules() if type(m).__name__ in names and m is not base]
    if not found:
        repeated = sorted({type(m).__name__ for m in base.modules() if isinstance(m, nn.ModuleList) for m in m})
        hint = f" (its repeated blocks: {', '.join(repeated)})" if repeated else ""
        given = f"none of parallel.wrap_classes {sorted(names)} is in the model" if class_names else (
            "it declares no _no_split_modules" if not names else f"none of its _no_split_modules {sorted(names)} is in the model")
        raise UserError(
            f"parallel.strategy: fsdp cannot find the decoder layers of {type(base).__name__} to shard: {given}; "
            f"set parallel.wrap_classes to the layer class name(s){hint}"
        )
    return found[::-1]


def _param_ids(module: nn.Module) -> set[int]:
    return {id(p) for p in module.parameters()}


def _units(model: nn.Module, class_names: Sequence[str]) -> tuple[list[nn.Module], nn.Module]:
    """(units to shard bottom-up, the tree's root) for one model.

    Units: the decoder layers; then the backbone (embeddings, final norm) and each head as units of
    their own, because `models.scalar_outputs` calls a classifier's backbone and head directly, not
    through the model's forward, and FSDP gathers a unit in its forward hook. A backbone or head
    whose weights are tied to another module (a causal LM's embeddings and LM head) stays in the
    root unit with it: FSDP requires tied weights in one unit.
    """
    from ppokit.models.loading import unwrap_peft

    from transformers import PreTrainedModel

    root = unwrap_peft(model)
    # A module of ppokit's own around another model's weights (the shared critic: a head on the
    # policy's base) has no layers of its own.
    units = decoder_layers(model, class_names) if isinstance(root, PreTrainedModel) else []
    prefix = getattr(root, "base_model_prefix", None)
    children = [(name, child) for name, child in root.named_children()]
    for name, child in sorted(children, key=lambda item: item[0] != prefix):  # backbone first
        if not any(True for _ in child.parameters()):
            continue
        inside = _param_ids(child)
        elsewhere = set().union(*(_param_ids(c) for n, c in children if n != name))
        if inside & elsewhere:
            continue
        units.append(child)
    return units, root


class Sharded:
    """FSDP2: weights, gradients and optimiser state of each sharded model split over the processes."""

    strategy = "fsdp"
    uneven_forwards = False  # every forward gathers the weights with the other processes: each must run as many

    def __init__(self, accelerator, settings, bf16: bool = False):
        fully_shard, _, MixedPrecisionPolicy, CPUOffloadPolicy, OffloadPolicy = _fsdp()
        from torch.distributed.device_mesh import init_device_mesh

        self.accelerator = accelerator
        self.settings = settings
        self.backward_separately = backward_separately(accelerator.num_processes)
        _process_group(accelerator)
        self.mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
        # Compute in bf16 with float32 master weights and float32 gradient reduction.
        self.mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        self.bf16 = bf16
        self.offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if settings.cpu_offload else OffloadPolicy()
        self._roots: list[nn.Module] = []  # root of every sharded tree
        self._skeleton: Optional[nn.Module] = None
        self._sharded_ids: set[int] = set()

    # ------------------------------------------------------------------ wrapping

    def shard(self, model: nn.Module, frozen: bool = False) -> nn.Module:
        """Shard one model in place (its decoder layers, backbone, heads, then the rest); returns it.

        FSDP keeps a tree's root unit gathered from its forward to its backward; a frozen model has no
        backward, so its root is freed after each forward like every other unit."""
        fully_shard = _fsdp()[0]
        if id(model) in self._sharded_ids:
            return model
        units, root = _units(model, self.settings.wrap_classes)
        kwargs = dict(mesh=self.mesh, mp_policy=self.mp_policy, offload_policy=self.offload)
        if not self.settings.cpu_offload:
            model.to(self.accelerator.device)  # with offload FSDP keeps the shards in host memory itself
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(root, **kwargs, reshard_after_forward=True if frozen else None)
        # FSDP takes the first module to run forward as the root of the tree; sampling may run a
        # sub-module first, so settle the root now.
        fully_shard.state(root)._lazy_init()
        # Gather each unit once here, outside inference mode: FSDP allocates its gather buffers on
        # first use and keeps them, and buffers first made under torch.inference_mode (sampling,
        # the reference pass) are inference tensors that training's autograd cannot use.
        for unit in [*units, root]:
            unit.unshard()
            unit.reshard()
        self._roots.append(root)
        self._sharded_ids.update({id(model), id(root)})
        return model

    def prepare(self, model, build):
        """Shard every child of `model` that holds weights (policy, value model) as a tree of its own;
        the optimiser is built over the shards, so its state is 1/N per process too."""
        if self.accelerator.is_main_process:
            self._skeleton = meta_skeleton(model)
        for child in model.children():
            if any(p.requires_grad for p in child.parameters()):
                self.shard(child)
        optimizer, scheduler = build(model)
        return model, optimizer, scheduler

    def place_frozen(self, model):
        if id(model) in self._sharded_ids:
            return model  # already sharded as a trainable role (a critic's adapter on the reward model)
        if self.settings.shard_frozen:
            return self.shard(model, frozen=True)
        model = model.to(self.accelerator.device)
        # A whole frozen copy computes in the precision FSDP gives the sharded ones.
        return model.to(torch.bfloat16) if self.bf16 else model

    # ------------------------------------------------------------------ running

    def _fsdp_modules(self, model: nn.Module) -> list[nn.Module]:
        FSDPModule = _fsdp()[1]
        return [m for m in model.modules() if isinstance(m, FSDPModule)]

    @contextlib.contextmanager
    def generation(self, policy):
        """Gather the policy's weights once, sample every token of the rollout, then free them.

        Without it each decoded token would all-gather every layer again (the trap that made
        TRL's ZeRO-3 generation ~10x slow). Costs the whole policy's weights on each process for
        the duration (docs/parallel.md); `parallel.unshard_for_generation: false` turns it off.
        """
        if not self.settings.unshard_for_generation:
            yield
            return
        modules = self._fsdp_modules(policy)
        roots = {id(r) for r in self._roots}
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        try:
            yield
        finally:
            for m in modules:
                m.reshard()
                m.set_reshard_after_forward(id(m) not in roots, recurse=False)  # FSDP's defaults

    def no_sync(self, model, last):
        # Gradients are reduce-scattered after every micro-batch: accumulating them unsharded
        # (FSDP's set_requires_gradient_sync(False)) would hold full-size gradients, what FSDP saves.
        return contextlib.nullcontext()

    def clip_grad_norm_(self, model, max_norm):
        """The norm over every process's gradient shards (a DTensor reduced to one number); clipped when max_norm > 0."""
        from torch.distributed.tensor import DTensor

        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.accelerator.device)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    # ------------------------------------------------------------------ saving

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every weight of `model` whole, on the CPU of the main process ({} elsewhere); every process calls it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    @contextlib.contextmanager
    def consolidated(self, model):
        """On the main process a plain (unsharded) copy of `model` on the CPU with every full weight,
        built from the meta skeleton taken before sharding; None on the others. Every process enters."""
        state = self.full_state_dict(model)
        if not self.accelerator.is_main_process:
            yield None
            return
        plain = materialize(self._skeleton, state)
        try:
            yield plain
        finally:
            del plain, state

    def checkpoint_weights(self) -> "ShardedWeights":
        return ShardedWeights()


class ShardedWeights:
    """A checkpoint's weights and optimiser state under fsdp: one DCP folder (`sharded/`) to which every
    process writes its own shards, and which any number of processes can read (DCP reshards).

    The same interface as ppokit.run.checkpoint.PlainWeights: save(folder, parts, save_models, is_main) on
    every process, load(folder, parts). Only trainable tensors are written (a LoRA run's frozen base
    comes from the model path again); final/ is consolidated separately (`Sharded.consolidated`).
    """

    kind = "sharded"

    def save(self, folder: Path, parts, save_models, is_main: bool) -> None:
        """Every process writes its shards; the checkpoint is complete only when the main process finds every
        shard in it (a process writing into a folder the main one does not see is refused on every process)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(_training_state(parts.model, parts.optimizer), checkpoint_id=str(Path(folder) / SHARDED_DIR))
        problem = [missing_shards(Path(folder) / SHARDED_DIR) if is_main else None]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.broadcast_object_list(problem, src=0)
        if problem[0]:
            raise EveryProcessStops(f"{folder}: {problem[0]}; the checkpoint is not complete: every process must write into one "
                                    "folder that the main process sees (output_dir on a file system every node shares)")

    def load(self, folder: Path, parts) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        source = Path(folder) / SHARDED_DIR
        if not (source / ".metadata").is_file():
            raise UserError(f"{folder}: no {SHARDED_DIR}/.metadata (a checkpoint written under parallel.strategy fsdp has one)")
        from torch.distributed.checkpoint.api import CheckpointException

        state = _training_state(parts.model, parts.optimizer)
        try:
            dcp.load(state, checkpoint_id=str(source))
        except (Exception, CheckpointException) as e:  # DCP wraps each process's error in a CheckpointException, a BaseException
            failures = sorted((getattr(e, "failures", None) or {}).items())  # [(rank, (exception, traceback))]
            if failures:
                rank, failure = failures[0]
                cause = failure[0] if isinstance(failure, tuple) else failure
                said = f"process {rank}: {type(cause).__name__}: {str(cause).strip()}"
            else:
                said = str(e).strip() or type(e).__name__
            first = said.splitlines()[0]
            raise UnreadableShards(f"{SHARDED_DIR}/: cannot be read into this run's sharded model ({first})") from None
        set_state_dict(parts.model, parts.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(ignore_frozen_params=True, strict=False))


class UnreadableShards(UserError):
    """A checkpoint's shards that this run's sharded model cannot read; the checkpoint's loader names the checkpoint
    (`run.checkpoint_files.DamagedCheckpoint`)."""


def gradient_norm(parameters) -> torch.Tensor:
    """Global L2 norm of the gradients (used when gradient clipping, which returns it, is off)."""
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))


def missing_shards(folder: Path) -> str:
    """What of a DCP folder's shards is missing or cut short, going by its .metadata (where every tensor
    lies: file, offset, length), or "" when every shard is whole."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # pickle of DCP's own types: any error means a .metadata that cannot be used
        return f"{SHARDED_DIR}/.metadata: cannot be read ({type(e).__name__})"
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = Path(folder) / name
        if not file.is_file():
            return f"{SHARDED_DIR}/{name}: missing"
        if file.stat().st_size < end:
            return f"{SHARDED_DIR}/{name}: cut short ({file.stat().st_size} of {end} bytes)"
    return ""


def _training_state(model: nn.Module, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    weights, optim = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": weights, "optimizer": optim}


# --------------------------------------------------------------------------- a plain copy for saving


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model`'s structure (wrappers, adapters, configs, tied weights) whose parameters are
    on the meta device, so it costs no memory; buffers are copied (rotary tables: small)."""
    memo: dict[int, object] = {}
    for p in itertools.chain.from_iterable(m.parameters(recurse=False) for m in model.modules()):
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    return copy.deepcopy(model, memo)


def materialize(skeleton: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of `skeleton` holding the tensors of `state` (a full state dict of the same model)."""
    plain = copy.deepcopy(skeleton)
    missing = plain.load_state_dict(state, strict=False, assign=True).missing_keys
    _retie(plain)
    left = [n for n, p in plain.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"consolidated save: no full weight for {', '.join(left[:5])} (missing {missing[:5]})")
    return plain


def _retie(module: nn.Module) -> None:
    """load_state_dict(assign=True) gives tied weights separate tensors; tie them again."""
    for m in module.modules():
        tie = getattr(m, "tie_weights", None)
        if callable(tie) and hasattr(m, "get_input_embeddings") and not isinstance(m, _peft_types()):
            tie()


def _peft_types() -> tuple[type, ...]:
    try:
        from peft import PeftModel

        return (PeftModel,)
    except ImportError:
        return ()
