"""The rollout-engine interface: what the trainer asks of whatever samples its episodes.

Two kinds of engine sit behind it: one that samples from the training weights themselves (`hf`:
transformers with its KV cache), and one that holds its own copy of the policy (an inference server
such as vLLM), whose weights the trainer pushes after every optimiser update and whose logprobs are
not bit-for-bit the training forward's.

Engines take requests: one `Request` per model turn (prompt token ids, `Sampling`, an id, a seed), many
in flight, each handed back as a `Sampled` (token ids, logprobs, finish reason) as soon as it is done
(`submit` / `step`); `generate` is the one-turn case (submit a batch, wait for all of it).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Optional, Protocol, Sequence

from ppokit.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ppokit.training.episodes import Episodes
    from ppokit.errors import UserError

PURPOSES = ("train", "eval", "greedy")


@dataclass(frozen=True)
class Sampling:
    """How to sample one call's responses; the same meaning for every engine.

    temperature: tokens are drawn from softmax(logits / temperature); the logprobs returned are of that
    full distribution (not of the truncated one), which is what the training forward computes.
    top_k 0, top_p 1, min_p 0: off. greedy: the most likely token at every step (logprobs still at
    `temperature`). max_new_tokens: the response budget; stop_token_ids: the tokens that end a response, any of
    them (e.g. gpt-oss: <|return|> ends an answer, <|call|> a tool call; the conversation decides them), () for none
    (None or one id are taken as such: `stop_ids`).
    """

    max_new_tokens: int
    temperature: float
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    greedy: bool = False

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", stop_ids(self.stop_token_ids))

    @classmethod
    def for_purpose(cls, hp, stop_token_ids: Sequence[int], purpose: str = "train") -> "Sampling":
        """The sampling of the `ppo:` section `hp` for one purpose:
          train   temperature, top_k / top_p / min_p;
          eval    evaluate() and sample generations: eval_temperature (null: temperature), greedy at 0;
          greedy  the most likely token at every step (a greedy-baseline estimator's responses).
        Only training reads the logprobs; a greedy sampling keeps them at the training temperature."""
        if purpose not in PURPOSES:
            raise ValueError(f"purpose must be one of {PURPOSES}, got {purpose!r}")
        eval_temperature = hp.temperature if hp.eval_temperature is None else hp.eval_temperature
        greedy = purpose == "greedy" or (purpose == "eval" and eval_temperature == 0)
        temperature = eval_temperature if purpose == "eval" and not greedy else hp.temperature
        return cls(hp.response_length, temperature, stop_token_ids, top_k=hp.top_k, top_p=hp.top_p, min_p=hp.min_p, greedy=greedy)

    @classmethod
    def by_purpose(cls, hp, stop_token_ids: Sequence[int]) -> dict[str, "Sampling"]:
        """`for_purpose` for each of `PURPOSES`."""
        return {purpose: cls.for_purpose(hp, stop_token_ids, purpose) for purpose in PURPOSES}


def stop_ids(ids) -> tuple[int, ...]:
    """Stop tokens as every engine reads them: a tuple of ids (None: none; one id: that one)."""
    if ids is None:
        return ()
    return (int(ids),) if isinstance(ids, int) else tuple(int(i) for i in ids)


FINISH_REASONS = ("stop", "length", "abort")
SEED_BITS = 62  # request seeds lie in [0, 2**62): any engine's generator takes them


@dataclass(frozen=True)
class Request:
    """One model turn asked of an engine (`RolloutEngine.submit`).

    request_id: unique among the engine's unfinished requests (and kept ones, below).
    prompt: the token ids to continue (a multi-turn episode's whole context so far).
    sampling: how to sample the completion (`Sampling`).
    seed: the request's own random stream. With a seed its tokens and logprobs are a function of (the weights, its
        prompt, its sampling, its seed) alone: not of which other requests share its decoding steps, nor of when it
        was submitted (`request_seed` makes one from a key such as (run seed, update, row, turn)). None: the shared
        stream, torch's global generator, drawn in the order of the requests of one `submit` call, which are then
        decoded as one batch (what `generate` submits): their results depend on that batch, as they always have.
    keep: hold this request's keys and values after it completes, for a later request that `continues` it (hf; an
        engine with a prefix cache of its own (vLLM) reuses prefixes without being asked). Needs a seed.
    continues: the id of an earlier, kept request whose prompt + completion this prompt starts with: the engine reads
        only what follows (hf: the kept keys and values move to this request). Its results are then a function of that
        request's too (its keys and values as they were computed), which is what an episode's next turn is.
    """

    request_id: str
    prompt: Sequence[int]
    sampling: Sampling
    seed: Optional[int] = None
    keep: bool = False
    continues: Optional[str] = None

    def __post_init__(self):
        if self.seed is None and (self.keep or self.continues is not None):
            raise ValueError(f"request {self.request_id!r}: keep and continues need a seed (a request decoded on its own)")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"request {self.request_id!r}: seed {self.seed} is outside [0, 2**64)")
        if not self.prompt:
            raise ValueError(f"request {self.request_id!r}: the prompt is empty")


@dataclass(frozen=True)
class Sampled:
    """What an engine hands back for one request (`RolloutEngine.step`, `abort`).

    token_ids: the sampled tokens, the stop token included when it ended the completion.
    logprobs: one per token, of the full distribution at `sampling.temperature` (not of the top_k / top_p / min_p
        truncated one; vLLM: of the truncated one when those are set, see docs/rollout.md), float32 values.
    finish_reason: "stop" (the stop token), "length" (sampling.max_new_tokens tokens), "abort" (`abort`: the tokens
        so far).
    cached_tokens: prompt tokens whose keys and values were not computed again (hf: those of the request it
        `continues`; vLLM: its prefix-cache hits).
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    cached_tokens: int = 0

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"request {self.request_id!r}: finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}")


def request_seed(*key: int) -> int:
    """A request's seed from a key of integers, e.g. (run seed, update, row, turn): the same key, the same seed on any
    machine and in any order of completion; different keys, independent streams (a hash, not a sum)."""
    digest = hashlib.blake2b(repr(tuple(int(k) for k in key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


_GENERATE_CALLS = itertools.count()


def generate(engine: "RolloutEngine", prompts: list[list[int]], sampling: Sampling, pad_token_id: int, device=None) -> "Episodes":
    """What every engine's `generate` is: one response per prompt, as seedless requests of one `submit` call waited
    for (`complete`), packed by the one function that builds Episodes (`episodes.pack`), rows in the order of prompts."""
    from ppokit.training.episodes import Span, pack

    call = next(_GENERATE_CALLS)
    completions = complete(engine, [Request(f"generate-{call}-{i}", p, sampling) for i, p in enumerate(prompts)])
    return pack(prompts, [[Span(c.token_ids, c.logprobs)] for c in completions], [c.finish_reason == "stop" for c in completions],
                pad_token_id, device)


def complete(engine: "RolloutEngine", requests: Sequence[Request]) -> list[Sampled]:
    """Submit `requests` and step the engine until every one has completed -> their completions in request order
    (the one-turn case: what `generate` does)."""
    engine.submit(requests)
    wanted = {r.request_id for r in requests}
    done: dict[str, Sampled] = {}
    with engine.serving():
        while wanted - done.keys():
            for completion in engine.step():
                done[completion.request_id] = completion
    return [done[r.request_id] for r in requests]


class EngineLost(RuntimeError):
    """An engine outside the trainer's process (a vLLM server) died, refused, or did not answer in time; its message is
    one line naming it. A run ends with that line and where to resume (`engine_lost`)."""


def engine_lost(error: BaseException, last_checkpoint) -> Optional["UserError"]:
    """The one line a run ends with when an engine outside its process is lost (`EngineLost`), naming the last complete
    checkpoint; None for any other error."""
    from ppokit.errors import UserError

    if not isinstance(error, EngineLost):
        return None
    last = f"the last complete checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint of this run was written yet"
    return UserError(f"{error}; {last}: continue with --resume once it serves again")


@dataclass(frozen=True)
class EngineSetup:
    """What the trainer hands to the engine it builds (`ppokit.engines.build`); each engine reads what it needs.

    policy: the current policy module (unwrapped), asked for at every call: the trainer's wrapping may change it.
    pad_token_id: what pads every model input (`models.input_pad_id`). device: where the episodes' tensors go.
    rows_per_forward: rows per forward pass while sampling (ppo.local_rollout_forward_batch_size).
    sampling_contexts(policy): context managers entered in order around sampling from the training weights:
        the parallel strategy's (fsdp: the policy unsharded) and the training forward's precision (autocast),
        so that the sampled logprobs are the training forward's (the first PPO ratio is 1).
    settings: the `rollout:` section.
    longest_sequence: the longest prompt + the response budget (an engine holding its own KV cache sizes it so).
    rows_per_rollout: the rows of one update's rollout on this process (sequences decoded together).
    seed: the run's seed (an engine with a generator of its own).
    """

    policy: Callable[[], "nn.Module"]
    pad_token_id: int
    device: "torch.device"
    rows_per_forward: int
    sampling_contexts: Callable[["nn.Module"], Sequence[ContextManager]]
    settings: Any  # the `rollout:` section, ppokit.config.schema.RolloutConfig (config imports this package: no import back)
    longest_sequence: int = 0
    rows_per_rollout: int = 0
    seed: int = 0


@dataclass(frozen=True)
class EngineSizing:
    """What `ppokit plan` knows of a run, for an engine class to say its memory (`memory(sizing)`), read from
    config files alone (nothing loaded, vLLM not imported).

    model_config: the policy's transformers config. dims: the plan's model dimensions (layers, kv = key/value
    heads x head_dim, vocab, ...). weight_bytes: the policy's weights once, unquantised, in `dtype` (a copy of them).
    act_bytes: bytes per activation of the training forwards. rows_per_forward / rows_per_rollout / longest_sequence /
    settings: as in EngineSetup (rows_per_rollout 0: unknown). device_memory: the device's bytes; on_gpu: it is a GPU.
    """

    model_config: Any
    dims: dict
    weight_bytes: int
    dtype: "torch.dtype"
    act_bytes: int
    rows_per_forward: int
    rows_per_rollout: int
    longest_sequence: int
    settings: Any  # the `rollout:` section
    device_memory: int
    on_gpu: bool


@dataclass(frozen=True)
class EngineMemory:
    """An engine's device memory, in bytes, as `ppokit plan` counts it.

    held: memory of its own (a weight copy, a KV cache reserved up front), from its start to the run's end, or, with
        `released_for_training`, given back during each optimisation (`release`) and taken back before sampling again.
    sampling: what sampling needs on top of everything else while it runs.
    what: `held` in words, for the plan's table ("" when it holds nothing). lighter: `rollout:` keys and values with
        which it would hold less (what the plan's suggestions may try).
    """

    held: int = 0
    sampling: int = 0
    released_for_training: bool = False
    what: str = ""
    lighter: tuple[tuple[str, Any], ...] = ()

    def during(self, phase: str) -> int:
        """What it holds during one of the plan's phases (sampling, forward, training)."""
        return 0 if phase == "training" and self.released_for_training else self.held


def step_logits_bytes(rows: int, vocab: int) -> int:
    """One decoding step's float32 logits over the vocabulary and their log-softmax, for `rows` sequences."""
    return 2 * rows * vocab * 4


class RolloutEngine(Protocol):
    """What samples episodes for the trainer; an engine class is declared once in `ppokit.engines.ENGINES`.

    The class:
    create(setup): the engine, built from what the trainer hands over (`EngineSetup`; its own `rollout:` keys
        in `setup.settings`).
    memory(sizing): what it holds of its own on the device (all run long, or freed while training) and what
        sampling needs on top (`EngineMemory`), from config files alone (no engine library imported): `ppokit plan`.
    check_installed(): None, or a UserError saying how to install what the engine needs (before any work).
    check(model_config, settings): None, or a UserError: what the engine refuses about the policy of this transformers
        config (named by its `_name_or_path`) and its `rollout:` keys, check_installed's refusal included; made
        when the engine is built, and by `ppokit plan` from config files, so that the plan refuses what a run would.

    An engine:
    logprobs_are_trainers: True when the logprobs `generate` returns are the training forward's own
        (same weights, same kernels, same precision), so they serve as the PPO ratio's old logprobs.
        False: the trainer recomputes them with one no-gradient forward of the policy and logs the
        difference (an external engine: vLLM).
    generate(prompts, sampling): one response per prompt (token ids, no padding) -> Episodes with
        query_ids, response_ids, attention_mask, loss_mask, logprobs, ended, score_index filled.
        Rows come back in the order of `prompts`. The one-turn case of the requests below: every prompt a
        seedless request of one `submit`, waited for, packed by `episodes.pack` (`base.generate`); randomness from
        torch's generator.
    sync_weights(policy): make the engine sample from `policy`'s current weights (after an update);
        a no-op for an engine that samples from the training weights.
    release() / resume(): around training, free / take back the engine's memory (KV cache, its
        weight copy); no-ops where there is nothing to free.
    close(): free everything; the trainer calls it when train() ends. A later `generate` (evaluate() or
        sample_completions() after training) must still work: an engine that freed itself builds itself again.

    Built by `ppokit.engines.build(name, EngineSetup)`; the trainer calls `generate` in stage 1 (and for
    evaluation and greedy baselines), `release` / `resume` / `sync_weights` around and after the optimisation
    of every update (`training_between_rollouts`), `sync_weights` after a resume restored the weights.
    """

    logprobs_are_trainers: bool

    @classmethod
    def create(cls, setup: EngineSetup) -> "RolloutEngine": ...

    @staticmethod
    def memory(sizing: EngineSizing) -> EngineMemory: ...

    @staticmethod
    def check_installed() -> None: ...

    @staticmethod
    def check(model_config: Any, settings: Any) -> None: ...

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> "Episodes": ...

    # Requests (one per model turn, many in flight). One thread drives an engine: submit, step, abort and forget are
    # called from the thread that entered `serving()`; environment calls run elsewhere meanwhile.
    #   submit(requests): queue them (returns at once). A request id already unfinished or kept is refused.
    #   step(): advance every unfinished request by one decoding step (admitting queued ones as room frees) -> the
    #     requests that completed in it (or [] when nothing is unfinished).
    #   unfinished(): how many submitted requests have not completed.
    #   abort(request_ids): stop them -> their completions so far (finish_reason "abort"); unknown ids are skipped.
    #   forget(request_ids): drop what is kept for them (`Request.keep`) that no request will continue.
    #   serving(): a context around a rollout's requests in which the engine is ready to sample (hf: the policy in
    #     eval mode under the sampling contexts, entered once, not at every step); step() outside it enters it itself.

    def submit(self, requests: Sequence[Request]) -> None: ...

    def step(self) -> list[Sampled]: ...

    def unfinished(self) -> int: ...

    def abort(self, request_ids: Iterable[str]) -> list[Sampled]: ...

    def forget(self, request_ids: Iterable[str]) -> None: ...

    def serving(self) -> ContextManager: ...

    def sync_weights(self, policy: "nn.Module") -> None: ...

    def release(self) -> None: ...

    def resume(self) -> None: ...

    def close(self) -> None: ...


# Every method an engine class must have (`ppokit.engines.engine_class` checks them), read from the Protocol
# (`logprobs_are_trainers` may be set per instance).
ENGINE_METHODS = tuple(name for name, value in vars(RolloutEngine).items()
                       if not name.startswith("_") and callable(getattr(value, "__func__", value)))


@contextlib.contextmanager
def training_between_rollouts(engine: RolloutEngine, policy: "nn.Module"):
    """Around the optimisation of an update: the engine's memory released to the training, taken back after
    it (also when it fails), and, once the update is done, the engine synced to the trained `policy`."""
    engine.release()
    try:
        yield
    finally:
        engine.resume()
    engine.sync_weights(policy)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank takes one of these


def served_lora_rank(rank: int) -> int:
    """vLLM's max_lora_rank for an adapter of rank `rank`: the smallest it takes that holds it."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise UserError(f"lora.r: {rank} is over vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]}), so rollout.lora_merge: false "
                        "cannot serve the adapter; lower lora.r or set rollout.lora_merge: true")
    return fits[0]
