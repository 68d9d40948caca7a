"""The `hf` rollout engine: sampling from the training weights themselves with transformers' KV cache, so its
logprobs are the training forward's and there is nothing to sync or release.

Two decoders behind one request interface (`base.RolloutEngine`):
- seeded requests: `slots.SlotDecoder`, continuous batching in fixed-shape slots, each request with its own
  generator: its result does not depend on what else is in flight, nor on when it arrived.
- seedless requests (what `generate` submits): the requests of one `submit` call decoded together by `HFSampler`
  in lock-step, drawing from torch's global generator, as every single-turn rollout always has (bit for bit). It
  stays because it is the faster one there: single-turn rollouts routed through the slot decoder instead (keyed seeds,
  2026-12-07, benchmarks/rollout_engines.py --modes sampling --engines hf --sizes 50m, quiet 2-core x86-64, alternating)
  sampled 856 and 774 tokens/s against the lock-step's 872 and 919, with 70-85 MB more peak memory (docs/speed.md).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Optional, Sequence, Union

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from ppokit.training import algo
from ppokit.engines.base import (Sampled, EngineMemory, EngineSetup, EngineSizing, Request, Sampling, generate,
                                 step_logits_bytes, stop_ids)
from ppokit.engines.fast_decode import DecodeStep, why_not
from ppokit.engines.sampling import multinomial_rows, reproduces_multinomial, truncate_distribution
from ppokit.engines.slots import SlotDecoder
from ppokit.training.episodes import Episodes
from ppokit.errors import UserError
from ppokit.models.compiled import check_available
from ppokit.models.forwards import causal_lm_step, eval_mode, left_pad, position_ids_from_mask
from ppokit.models.loading import position_limit, unwrap_peft


# Rows that have produced the stop token leave the forward batch every this many decoding steps (the
# trainer's setting; measured on the variable-shape benchmark: ~10% less sampling time, same tokens).
COMPACT_FINISHED_ROWS_EVERY = 8


class HFEngine:
    """A `RolloutEngine` sampling from the policy itself: in eval mode (no dropout), under `sampling_contexts`
    (the parallel strategy's and the training forward's precision: the first PPO ratio is 1), back in train mode after.

    policy: the policy module, or a function returning the current one. pad_token_id: left-pads the prompts.
    rows_per_forward: rows per sampling forward: the lock-step batch's, and the slot decoder's number of slots.
    max_sequence: the slot decoder's positions per sequence (a seeded request's prompt + max_new_tokens must fit);
    None: the model's position limit. read_in_steps / read_together: how the slot decoder reads a request's prompt, by
    its number of tokens (`slots.SlotDecoder`; None: its defaults).
    logprobs_are_trainers: what the engine declares (True: the sampled logprobs
    are the training forward's); False makes the trainer recompute them as for an external engine (a test of that
    path with an engine whose answer is known). enforce_eager: False decodes the lock-step batches with
    `fast_decode.DecodeStep` (rollout.enforce_eager; refused with a UserError for a policy it does not apply to).
    """

    def __init__(self, policy: Union[nn.Module, Callable[[], nn.Module]], pad_token_id: int, device: torch.device,
                 rows_per_forward: int, sampling_contexts: Optional[Callable[[nn.Module], Sequence[ContextManager]]] = None,
                 logprobs_are_trainers: bool = True, max_sequence: Optional[int] = None, read_in_steps: Optional[int] = None,
                 read_together: Optional[int] = None, enforce_eager: bool = True):
        self._policy = policy
        self.pad_token_id = pad_token_id
        self.device = device
        self.rows_per_forward = rows_per_forward
        self.sampling_contexts = sampling_contexts or (lambda policy: ())
        self.logprobs_are_trainers = logprobs_are_trainers
        self.max_sequence = max_sequence
        self.read_in_steps, self.read_together = read_in_steps, read_together
        self._batches: deque[list[Request]] = deque()  # seedless requests, one lock-step batch per submit call and sampling
        self._decoder: Optional[SlotDecoder] = None  # seeded requests; built at the first one
        self._serving = False
        self._decode_step = None if enforce_eager else fast_decode_step(self.policy, device)

    @classmethod
    def create(cls, setup: EngineSetup) -> "HFEngine":
        return cls(setup.policy, setup.pad_token_id, setup.device, setup.rows_per_forward, setup.sampling_contexts,
                   max_sequence=setup.longest_sequence or None, enforce_eager=getattr(setup.settings, "enforce_eager", True))

    @property
    def policy(self) -> nn.Module:
        return self._policy if isinstance(self._policy, nn.Module) else self._policy()

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> Episodes:
        return generate(self, prompts, sampling, self.pad_token_id, self.device)

    # ------------------------------------------------------------------ requests

    def submit(self, requests: Sequence[Request]) -> None:
        requests = list(requests)
        taken = self._ids()
        for request in requests:
            if request.request_id in taken:
                raise ValueError(f"request id {request.request_id!r} is already unfinished or kept by the engine")
            taken.add(request.request_id)
        seeded = [r for r in requests if r.seed is not None]
        if seeded:
            decoder = self._slots()
            decoder.check(seeded)  # all refused before any is queued
            decoder.queue.extend(seeded)
        batches: dict[Sampling, list[Request]] = {}
        for request in requests:
            if request.seed is None:
                batches.setdefault(request.sampling, []).append(request)
        self._batches.extend(batches.values())

    def step(self) -> list[Sampled]:
        """One lock-step batch decoded whole (if one is queued), then one step of the slot decoder."""
        with self.serving():
            return self._step()

    @torch.inference_mode()
    def _step(self) -> list[Sampled]:
        done = self._lockstep(self._batches.popleft()) if self._batches else []
        if self._decoder is not None and self._decoder.unfinished():
            done += self._decoder.step(self.policy)
        return done

    def unfinished(self) -> int:
        return sum(map(len, self._batches)) + (self._decoder.unfinished() if self._decoder is not None else 0)

    def abort(self, request_ids: Iterable[str]) -> list[Sampled]:
        wanted = set(request_ids)
        aborted = [Sampled(r.request_id, [], [], "abort") for batch in self._batches for r in batch if r.request_id in wanted]
        self._batches = deque(kept for kept in ([r for r in batch if r.request_id not in wanted] for batch in self._batches) if kept)
        return aborted + (self._decoder.abort(wanted) if self._decoder is not None else [])

    def forget(self, request_ids: Iterable[str]) -> None:
        if self._decoder is not None:
            self._decoder.forget(request_ids)

    @contextlib.contextmanager
    def serving(self):
        """The policy in eval mode under the sampling contexts (under fsdp: gathered once), for every step inside."""
        if self._serving:
            yield
            return
        policy = self.policy
        with eval_mode(policy), contextlib.ExitStack() as inside:
            for context in self.sampling_contexts(policy):
                inside.enter_context(context)
            self._serving = True
            try:
                yield
            finally:
                self._serving = False

    def _ids(self) -> set[str]:
        batched = {r.request_id for batch in self._batches for r in batch}
        return batched | (self._decoder.ids() if self._decoder is not None else set())

    def _slots(self) -> SlotDecoder:
        if self._decoder is None:
            capacity = self.max_sequence
            if capacity is None:
                limit = position_limit(self.policy)
                if limit is None:
                    raise ValueError("the hf engine's seeded requests need max_sequence: the model's config states no position limit")
                capacity = limit.tokens
            self._decoder = SlotDecoder(self.rows_per_forward, capacity, self.pad_token_id, self.device, self.read_in_steps, self.read_together)
        return self._decoder

    def _lockstep(self, batch: list[Request]) -> list[Sampled]:
        """Seedless requests of one submit call and one sampling, decoded together by `HFSampler` (torch's generator)."""
        sampling = batch[0].sampling
        ids, mask = left_pad([list(r.prompt) for r in batch], self.pad_token_id, self.device)
        sampler = HFSampler(self.policy, sampling.max_new_tokens, sampling.temperature, sampling.stop_token_ids, self.pad_token_id,
                            self.rows_per_forward, top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p,
                            greedy=sampling.greedy, compact_every=COMPACT_FINISHED_ROWS_EVERY, decode_step=self._decode_step)
        episodes = sampler.sample(ids, mask)
        tokens = [episodes.response_ids[i][episodes.loss_mask[i]].tolist() for i in range(len(batch))]
        logprobs = [episodes.logprobs[i][episodes.loss_mask[i]].tolist() for i in range(len(batch))]
        ended = episodes.ended.tolist()
        return [Sampled(r.request_id, t, lp, "stop" if e else "length") for r, t, lp, e in zip(batch, tokens, logprobs, ended)]

    # ------------------------------------------------------------------ weights and memory

    def sync_weights(self, policy: nn.Module) -> None:
        """Nothing to push: sampling reads the training weights."""

    def release(self) -> None:
        """Free the slot decoder's caches and what it keeps between turns (refused while requests are unfinished);
        the lock-step decoder's cache lives for one batch."""
        if self._decoder is not None:
            self._decoder.release()

    def resume(self) -> None:
        pass

    def close(self) -> None:
        self.abort(self._ids())
        self.release()

    @staticmethod
    def check_installed() -> None:
        """transformers and torch are ppokit's own dependencies."""

    @staticmethod
    def check(model_config, settings) -> None:
        """Any causal LM transformers loads, with any `rollout:` keys of its own (none)."""

    @staticmethod
    def memory(sizing: EngineSizing) -> EngineMemory:
        """Nothing held of its own (it samples from the training weights, counted apart); while sampling
        rows_per_forward sequences of up to longest_sequence tokens: keys and values of every layer at the
        activations' width (the lock-step batch's cache, or the slot decoder's slots; their one scratch column each,
        its one prefill row and what it keeps between an episode's turns out of its slots are not counted), and one
        step's float32 logits and their log-softmax (`step_logits_bytes`)."""
        dims, rows = sizing.dims, sizing.rows_per_forward
        kv_cache = 2 * dims["layers"] * dims["kv"] * rows * sizing.longest_sequence * sizing.act_bytes
        return EngineMemory(sampling=kv_cache + step_logits_bytes(rows, dims["vocab"]))


def fast_decode_step(policy: nn.Module, device: torch.device) -> DecodeStep:
    """rollout.enforce_eager: false: the compiled decoding step for `policy`, or a UserError saying why it cannot be."""
    reason = why_not(unwrap_peft(policy))
    if reason is not None:
        raise UserError(f"rollout.enforce_eager: false: the hf engine's compiled decoding step is for Llama-family models, and this policy has {reason}; "
                        "set rollout.enforce_eager: true")
    check_available(device, key="rollout.enforce_eager: false", off="rollout.enforce_eager: true")
    return DecodeStep()


@dataclass
class HFSampler:
    """Batched ancestral sampling from a transformers causal LM with its KV cache (after the prompt's forward, its
    keys and values written in place into buffers sized for the whole response: `_PreallocatedLayer`).

    Tokens are drawn from the softmax of logits / temperature, truncated by top_k / top_p / min_p
    when they are set (`truncate_distribution`; all off by default, as in the reference
    implementations), or taken greedily (`greedy`, the argmax). Stops as soon as every row has
    produced a stop token (any of `stop_token_ids`). The logprobs kept are those of the full softmax at the temperature,
    not of the truncated distribution: they are what the training forward computes, so the PPO
    ratio on the first minibatch is 1 and the KL is the policy's own. Kept from sampling, they
    need no second policy forward: with dropout off they equal a fresh forward's.
    """

    model: torch.nn.Module
    response_length: int
    temperature: float
    stop_token_ids: tuple[int, ...]  # any of them ends a row (None or one id taken as such: `base.stop_ids`)
    pad_token_id: int
    batch_size: int = 64
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    greedy: bool = False  # argmax instead of sampling (evaluation at temperature 0, ReMax's baseline)
    # Every this many steps, rows that produced the stop token leave the forward batch (and the KV
    # cache); 0: they stay to the end, fed padding. The sampled tokens are the same either way.
    compact_every: int = 0
    # The decoding steps through this instead of the model's forward (`fast_decode.DecodeStep`, rollout.enforce_eager:
    # false): same draws, logprobs equal within float rounding; None: the model's own forward.
    decode_step: Optional[Callable] = None

    def __post_init__(self):
        self.stop_token_ids = stop_ids(self.stop_token_ids)

    @torch.inference_mode()
    def sample(self, query_ids: torch.Tensor, query_mask: torch.Tensor) -> Episodes:
        """query_ids, query_mask: (B, P) left-padded prompts -> Episodes of one response each: the response
        up to and including the stop token is real and trained on (one span from the first response
        column), its score at the last of those tokens."""
        chunks = [
            self._sample_chunk(query_ids[i : i + self.batch_size], query_mask[i : i + self.batch_size])
            for i in range(0, query_ids.shape[0], self.batch_size)
        ]
        width = max(c[0].shape[1] for c in chunks)
        pad = lambda t, v: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=v)  # noqa: E731
        response_ids = torch.cat([pad(c[0], self.pad_token_id) for c in chunks])
        logprobs = torch.cat([pad(c[1], 0.0) for c in chunks])
        if self.stop_token_ids:
            response_ids, response_mask = algo.truncate_after_stop(response_ids, self.stop_token_ids, self.pad_token_id)
            ended = algo.is_stop(response_ids, self.stop_token_ids).any(1)
        else:
            response_mask = torch.ones_like(response_ids, dtype=torch.bool)
            ended = torch.zeros(response_ids.shape[0], dtype=torch.bool, device=response_ids.device)
        return Episodes(
            query_ids=query_ids,
            response_ids=response_ids,
            attention_mask=torch.cat([query_mask.bool(), response_mask], dim=1),
            loss_mask=response_mask,
            logprobs=logprobs.masked_fill(~response_mask, 0.0),
            ended=ended,
            score_index=algo.last_token_index(response_mask),
        )

    def _sample_chunk(self, query_ids, query_mask):
        rows = query_ids.shape[0]
        attention_mask = query_mask.long()
        positions = position_ids_from_mask(attention_mask)
        logits, cache = causal_lm_step(self.model, query_ids, attention_mask, positions, logits_to_keep=1)
        _preallocate(cache, query_ids.shape[1] + self.response_length - 1)  # the last token is not fed back
        if self.decode_step is not None and not all(isinstance(layer, _PreallocatedLayer) for layer in getattr(cache, "layers", [None])):
            raise RuntimeError("the compiled decoding step needs the in-place cache in every layer")
        next_position = positions[:, -1:] + 1
        done = torch.zeros(rows, dtype=torch.bool, device=query_ids.device)
        stops = torch.tensor(self.stop_token_ids, dtype=torch.long, device=query_ids.device)
        active = None  # rows still in the forward batch, once finished rows have been dropped from it
        tokens, logprobs = [], []
        for step in range(self.response_length):
            scaled = logits[:, -1].float()
            step_logprobs = torch.log_softmax(scaled if self.temperature == 1.0 else scaled / self.temperature, dim=-1)
            token = self._choose(step_logprobs, active, rows)  # the rows still in the forward batch (all: active None)
            if active is not None:
                token = token.new_full((rows,), self.pad_token_id).index_copy_(0, active, token)
            token = token.masked_fill(done, self.pad_token_id)
            tokens.append(token)
            if active is None:
                logprobs.append(step_logprobs.gather(1, token.unsqueeze(1)).squeeze(1))
            else:  # a row out of the batch reads log 1: the placeholder `_with_placeholder_rows` gives it
                logprobs.append(step_logprobs.new_zeros(rows).index_copy_(0, active, step_logprobs.gather(1, token[active].unsqueeze(1)).squeeze(1)))
            if self.stop_token_ids:
                done |= torch.isin(token, stops)
                if bool(done.all()):
                    break
            if step + 1 == self.response_length:
                break
            if self.compact_every and (step + 1) % self.compact_every == 0 and _can_select_rows(cache):
                keep = ~done if active is None else ~done[active]
                if not bool(keep.all()):
                    kept = keep.nonzero().squeeze(1)
                    cache.batch_select_indices(kept)
                    attention_mask, next_position = attention_mask[kept], next_position[kept]
                    active = kept if active is None else active[kept]
            step_tokens = token if active is None else token[active]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=1)
            if self.decode_step is not None:
                logits = self.decode_step(self.model, step_tokens, next_position[:, 0], attention_mask, cache)
            else:
                logits, cache = causal_lm_step(self.model, step_tokens.unsqueeze(1), attention_mask, next_position, cache=cache)
            next_position = next_position + 1
        return torch.stack(tokens, 1), torch.stack(logprobs, 1)

    def _choose(self, step_logprobs: torch.Tensor, active: Optional[torch.Tensor], rows: int) -> torch.Tensor:
        """(n, V) logprobs at the temperature of the rows still in the forward batch (`active`, of `rows`; None: all)
        -> (n,) their next tokens. The draw is torch.multinomial's over all `rows` rows, the rows out of the batch
        included (`_with_placeholder_rows`): the same tokens from the same generator state, however many have left."""
        if self.greedy:
            return step_logprobs.argmax(-1)
        if self.top_k or self.top_p < 1 or self.min_p > 0:
            step_logprobs = truncate_distribution(step_logprobs, self.top_k, self.top_p, self.min_p)
        if step_logprobs.device.type == "cpu" and reproduces_multinomial():
            return multinomial_rows(step_logprobs.exp(), active, rows)
        if active is None:
            return torch.multinomial(step_logprobs.exp(), 1).squeeze(1)
        return torch.multinomial(_with_placeholder_rows(step_logprobs, active, rows).exp(), 1).squeeze(1)[active]


class _PreallocatedLayer(DynamicLayer):
    """A transformers `DynamicLayer` whose keys and values live in buffers of `width` columns allocated once: each
    forward writes its new columns in place and attention reads the filled ones (a view), where the dynamic layer
    concatenates, copying everything cached at every step (its cost grows with the square of the length). Attention
    reads the same values either way. Only what the lock-step decoder calls is kept in step with the buffers
    (update, batch_select_indices)."""

    def __init__(self, layer: DynamicLayer, width: int):
        super().__init__()
        keys, values = layer.keys, layer.values
        self.device, self.is_initialized, self.length = keys.device, True, keys.shape[-2]
        self._keys = keys.new_empty((*keys.shape[:-2], width, keys.shape[-1]))
        self._values = values.new_empty((*values.shape[:-2], width, values.shape[-1]))
        self._keys[..., : self.length, :] = keys
        self._values[..., : self.length, :] = values
        self._view()

    def _view(self) -> None:
        self.keys, self.values = self._keys[..., : self.length, :], self._values[..., : self.length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        start, end = self.length, self.length + key_states.shape[-2]
        self._keys[..., start:end, :] = key_states
        self._values[..., start:end, :] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._keys, self._values = self._keys[indices], self._values[indices]
        self._view()


def _preallocate(cache, width: int) -> None:
    """Every plain `DynamicLayer` of a transformers cache (after the prompt's forward) -> a `_PreallocatedLayer` of
    `width` columns; other layers (sliding windows, recurrent states) stay as they are."""
    layers = getattr(cache, "layers", None)
    for i, layer in enumerate(layers or []):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.shape[-2] <= width:
            layers[i] = _PreallocatedLayer(layer, width)


def _can_select_rows(cache) -> bool:
    """Whether every layer of a transformers cache can drop batch rows (recurrent-state layers may not)."""
    layers = getattr(cache, "layers", None)
    return hasattr(cache, "batch_select_indices") and layers is not None and all(hasattr(layer, "batch_select_indices") for layer in layers)


def _with_placeholder_rows(active_logprobs: torch.Tensor, active: torch.Tensor, rows: int) -> torch.Tensor:
    """(n, V) logprobs of the rows still sampling -> (rows, V), finished rows a placeholder (log 1 everywhere).

    torch.multinomial draws one exponential variate per element of its (rows, V) input, in order, and
    picks each row's argmax of p / q. Keeping the finished rows in that call keeps the random stream
    exactly as without compaction, so every unfinished row draws the same token it would have drawn.
    """
    full = active_logprobs.new_zeros(rows, active_logprobs.shape[1])
    full[active] = active_logprobs
    return full
