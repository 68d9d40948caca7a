"""The hf engine's requests: a slot decoder whose every forward has one shape, so that a request's tokens and
logprobs do not depend on what else is decoded beside it (continuous batching without batch effects).

Why one shape: a row of a matrix product can change in its last bits with the number of rows beside it (measured
on this project's CPUs: a row of X @ W for a 768 x 3072 weight differs by up to 1e-4 between 3 and 4 rows), and
attention's sums with the padding in front of a row. So:
- decoding: every step is one forward of `slots` rows, one per slot (an idle slot is fed a placeholder token),
  against `capacity` cached positions per slot. A slot's token at position p is written at column p of its own
  cache (no padding in front of it: its real keys are columns 0..p), and a 4-D mask shows each row its own
  columns 0..p only.
- reading a prompt: a request with few tokens to read (its prompt, or what follows the request it continues: at
  most `read_in_steps`, by default as many as there are slots) reads them in its slot through the decoding steps,
  one token per step, beside the other slots' decoding (no forward of its own: on CPU a forward's fixed cost is
  most of a small model's); a longer one is read alone (one row, its own length) into a one-row cache of the same
  capacity, then copied into its slot; requests with the same prompt read alone in one step (a group's samples)
  share that read, which is the same computation. Which way a request is read depends on the request alone.
- sampling: each request has its own torch.Generator seeded with its seed; a token is argmax(p / E) with E ~ Exp(1)
  drawn per vocabulary entry from the request's generator (the exponential race torch.multinomial runs for one
  sample); greedy is the argmax of the logprobs.
A request's result is then a function of (weights, prompt, sampling, seed) and of the engine's shape (slots,
capacity, the process's CPU threads), never of the other requests or of the step at which it arrived.

Between turns (`Request.keep` / `continues`) the keys and values of a finished request (its prompt and every
token it fed back) are copied out of its slot and kept; the request that continues it copies them into the
prefill row and reads only its new tokens (the last sampled token and the observation). An idle slot is never
held for an episode waiting on its environment.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from transformers.cache_utils import Cache

from ppokit.engines.base import Completion, Request
from ppokit.engines.sampling import truncate_distribution
from ppokit.models import causal_lm_step

# Attention implementations that read a 4-D mask as given: a boolean mask (sdpa) or an additive one (eager).
MASKED_ATTENTION = {"sdpa": "bool", "eager": "additive"}


class SlotCache(Cache):
    """Keys and values of `rows` sequences, `capacity` positions each: per layer (rows, kv heads, capacity, head dim),
    allocated at the first write. `write_at` (rows, q): the column each new key of a forward goes to (set before it)."""

    def __init__(self, rows: int, capacity: int):
        super().__init__(layers=[])
        self.rows, self.capacity = rows, capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.write_at: Optional[torch.Tensor] = None

    def allocate_like(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Tensors for every layer, shaped as another cache's (their rows and lengths aside)."""
        def blank(t):
            return t.new_zeros((self.rows, t.shape[-3], self.capacity, t.shape[-1]))

        self.keys, self.values = [blank(k) for k in keys], [blank(v) for v in values]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == len(self.keys):
            self.keys.append(key_states.new_zeros((self.rows, key_states.shape[1], self.capacity, key_states.shape[-1])))
            self.values.append(value_states.new_zeros((self.rows, value_states.shape[1], self.capacity, value_states.shape[-1])))
        rows = torch.arange(self.rows, device=key_states.device).unsqueeze(1)
        # (rows, q) columns; the indexed result is (rows, q, heads, head dim)
        self.keys[layer_idx][rows, :, self.write_at] = key_states.transpose(1, 2)
        self.values[layer_idx][rows, :, self.write_at] = value_states.transpose(1, 2)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are given to every forward; nothing reads this to place tokens

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.capacity

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.capacity, 0

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    def copy_row(self, source: "SlotCache", source_row: int, row: int, columns: int) -> None:
        """Columns [0, columns) of `source`'s row into this cache's `row`."""
        for mine, theirs in ((self.keys, source.keys), (self.values, source.values)):
            for layer, tensor in enumerate(theirs):
                mine[layer][row, :, :columns] = tensor[source_row, :, :columns]


@dataclass
class _Kept:
    """A finished request's keys and values, kept for the request that continues it."""

    tokens: list[int]  # its prompt + completion: what a continuing prompt starts with
    keys: list[torch.Tensor]  # per layer (kv heads, n, head dim), n = len(tokens) - 1 (its last token was never fed)
    values: list[torch.Tensor]


class _Rows:
    """Kept keys and values seen as a one-row cache (what `SlotCache.copy_row` reads)."""

    def __init__(self, kept: _Kept):
        self.keys = [k.unsqueeze(0) for k in kept.keys]
        self.values = [v.unsqueeze(0) for v in kept.values]


@dataclass
class _Running:
    """A request in a decoding slot: its prompt's tokens are fed first (those not read already), then each token it samples."""

    request: Request
    generator: Optional[torch.Generator]
    fed: int  # columns of its slot written: tokens fed so far
    cached: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def next_input(self) -> int:
        prompt = self.request.prompt
        return prompt[self.fed] if self.fed < len(prompt) else self.tokens[-1]

    @property
    def samples(self) -> bool:
        """Whether the forward that just fed its last known token gives its next token."""
        return self.fed == len(self.request.prompt) + len(self.tokens)

    def finish_reason(self) -> Optional[str]:
        sampling = self.request.sampling
        if self.tokens[-1] in sampling.stop_token_ids:
            return "stop"
        return "length" if len(self.tokens) >= sampling.max_new_tokens else None

    def completion(self, reason: str) -> Completion:
        return Completion(self.request.request_id, list(self.tokens), list(self.logprobs), reason, self.cached)


class SlotDecoder:
    """Requests decoded in `slots` fixed slots of `capacity` positions (see the module docstring).

    read_in_steps: a request with at most this many tokens to read (its prompt, or what follows the request it
    continues) reads them through the decoding steps, one per step, in its slot (default: `slots`); a longer one
    is read alone first. Which way depends on the request alone. pad_token_id: what an idle slot is fed. The model is handed to every `step` (the engine's current policy);
    the caller holds torch.inference_mode and the sampling contexts around it.
    """

    def __init__(self, slots: int, capacity: int, pad_token_id: int, device: torch.device, read_in_steps: Optional[int] = None):
        self.slots, self.capacity, self.pad_token_id, self.device = slots, capacity, pad_token_id, torch.device(device)
        self.read_in_steps = slots if read_in_steps is None else read_in_steps
        self.queue: deque[Request] = deque()
        self.running: list[Optional[_Running]] = [None] * slots
        self.kept: dict[str, _Kept] = {}
        self._decode: Optional[SlotCache] = None
        self._prefill: Optional[SlotCache] = None
        self._prefilled: Optional[tuple[tuple[int, ...], torch.Tensor]] = None  # (prompt, its logits) the prefill row holds

    # ------------------------------------------------------------------ bookkeeping

    def check(self, requests: list[Request]) -> None:
        """Refuse what the decoder cannot serve, before any of `requests` is queued."""
        continued = {queued.continues for queued in self.queue} - {None}
        for request in requests:
            self._check(request, continued)
            continued.add(request.continues)

    def _check(self, request: Request, continued: set) -> None:
        if len(request.prompt) + request.sampling.max_new_tokens > self.capacity:
            raise ValueError(f"request {request.request_id!r}: prompt ({len(request.prompt)} tokens) + max_new_tokens "
                             f"({request.sampling.max_new_tokens}) is over the engine's {self.capacity} positions per sequence")
        if request.continues is not None:
            kept = self.kept.get(request.continues)
            if kept is None:
                raise ValueError(f"request {request.request_id!r} continues {request.continues!r}, which is not kept "
                                 "(never submitted with keep, continued already, forgotten or released)")
            if request.continues in continued:
                raise ValueError(f"request {request.request_id!r} continues {request.continues!r}, which another request continues already")
            if list(request.prompt[: len(kept.tokens)]) != kept.tokens or len(request.prompt) <= len(kept.tokens) - 1:
                raise ValueError(f"request {request.request_id!r}: its prompt does not start with the prompt + completion of "
                                 f"{request.continues!r}, which it continues")

    def ids(self) -> set[str]:
        """Every request id the decoder knows: queued, running and kept."""
        return {r.request_id for r in self.queue} | {s.request.request_id for s in self.running if s} | set(self.kept)

    def unfinished(self) -> int:
        return len(self.queue) + sum(s is not None for s in self.running)

    def abort(self, request_ids: Iterable[str]) -> list[Completion]:
        wanted = set(request_ids)
        aborted = [Completion(r.request_id, [], [], "abort") for r in self.queue if r.request_id in wanted]
        self.queue = deque(r for r in self.queue if r.request_id not in wanted)
        for i, slot in enumerate(self.running):
            if slot is not None and slot.request.request_id in wanted:
                aborted.append(slot.completion("abort"))
                self.running[i] = None
        return aborted

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.kept.pop(request_id, None)

    def release(self) -> None:
        """Free the caches and everything kept (nothing may be running)."""
        if self.unfinished():
            raise RuntimeError(f"the hf engine has {self.unfinished()} unfinished requests; abort them before training")
        self.kept.clear()
        self._decode = self._prefill = self._prefilled = None

    # ------------------------------------------------------------------ decoding

    def step(self, model) -> list[Completion]:
        """Admit queued requests into free slots (each prefilled alone, its first token sampled), then one decoding
        step of every slot -> the requests that completed."""
        done = []
        self._prefilled = None  # shared only between requests admitted in one step (the weights may change between steps)
        for i in range(self.slots):
            while self.running[i] is None and self.queue:
                finished = self._admit(model, self.queue.popleft(), i)
                if finished is not None:
                    done.append(finished)
        if any(self.running):
            done += self._decode_step(model)
        return done

    def _admit(self, model, request: Request, slot: int) -> Optional[Completion]:
        """Put `request` in the free `slot`: with what it continues copied in, its prompt to be read in the decoding steps,
        or read alone now (its first token sampled then) -> its completion if that first token already ended it."""
        kept = self.kept.pop(request.continues) if request.continues is not None else None
        start = len(kept.tokens) - 1 if kept is not None else 0
        running = _Running(request, _generator(request, self.device), fed=start, cached=start)
        if len(request.prompt) - start <= self.read_in_steps:
            if kept is not None:
                self._decode_cache(kept.keys, kept.values).copy_row(_Rows(kept), 0, slot, start)
            self.running[slot] = running
            return None
        if self._prefill is None:
            self._prefill = SlotCache(1, self.capacity)
        prefill = self._prefill
        if kept is not None:
            if not prefill.allocated:
                prefill.allocate_like(kept.keys, kept.values)
            prefill.copy_row(_Rows(kept), 0, 0, start)
        prompt = tuple(request.prompt)
        if kept is None and self._prefilled is not None and self._prefilled[0] == prompt:
            logits = self._prefilled[1]  # the prompt the prefill row holds already (a group's samples): the same bits
        else:
            new = torch.tensor([list(request.prompt[start:])], dtype=torch.long, device=self.device)
            positions = torch.arange(start, len(request.prompt), device=self.device).unsqueeze(0)
            prefill.write_at = positions
            logits, _ = causal_lm_step(model, new, self._mask(model, positions), positions, cache=prefill, logits_to_keep=1)
            if not prefill.allocated:
                raise ValueError("the hf engine's requests need a model whose layers cache keys and values (full attention)")
        self._prefilled = (prompt, logits) if kept is None else None
        running.fed = len(request.prompt)
        self._sample(logits[:, -1], [running])
        reason = running.finish_reason()
        if reason is not None:
            self._finish(running, prefill, 0)
            return running.completion(reason)
        self._decode_cache(prefill.keys, prefill.values).copy_row(prefill, 0, slot, running.fed)
        self.running[slot] = running
        return None

    def _decode_cache(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> SlotCache:
        """The slots' cache, allocated like `keys` / `values` if no forward has made it yet."""
        if self._decode is None:
            self._decode = SlotCache(self.slots, self.capacity)
        if not self._decode.allocated:
            self._decode.allocate_like(keys, values)
        return self._decode

    def _decode_step(self, model) -> list[Completion]:
        """One forward of every slot: each running request's next token in (a prompt token or the last it sampled)."""
        inputs = [(slot.next_input(), slot.fed) if slot is not None else (self.pad_token_id, 0) for slot in self.running]
        for slot in self.running:
            if slot is not None:
                slot.fed += 1
        tokens, positions = torch.tensor(inputs, dtype=torch.long, device=self.device).unsqueeze(-1).unbind(1)
        if self._decode is None:
            self._decode = SlotCache(self.slots, self.capacity)
        self._decode.write_at = positions
        logits, _ = causal_lm_step(model, tokens, self._mask(model, positions), positions, cache=self._decode, logits_to_keep=1)
        if not self._decode.allocated:
            raise ValueError("the hf engine's requests need a model whose layers cache keys and values (full attention)")
        sampling = [slot if slot is not None and slot.samples else None for slot in self.running]
        self._sample(logits[:, -1], sampling)
        done = []
        for i, slot in enumerate(sampling):
            reason = slot.finish_reason() if slot is not None else None
            if reason is not None:
                self._finish(slot, self._decode, i)
                done.append(slot.completion(reason))
                self.running[i] = None
        return done

    def _finish(self, running: _Running, cache: SlotCache, row: int) -> None:
        """Keep a finished request's keys and values (every token it fed) when it asked to be continued."""
        if running.request.keep:
            fed = running.fed  # its prompt and every sampled token but the last, which was never fed
            self.kept[running.request.request_id] = _Kept(
                list(running.request.prompt) + running.tokens,
                [k[row, :, :fed].clone() for k in cache.keys], [v[row, :, :fed].clone() for v in cache.values])

    def _mask(self, model, positions: torch.Tensor) -> torch.Tensor:
        """(rows, q) positions -> the 4-D mask (rows, 1, q, capacity): each query sees its own row's columns up to its
        position, as the model's attention takes it (boolean for sdpa, additive for eager)."""
        columns = torch.arange(self.capacity, device=positions.device)
        allowed = (columns <= positions.unsqueeze(-1)).unsqueeze(1)
        kind = MASKED_ATTENTION.get(getattr(model.config, "_attn_implementation", None) or "eager")
        if kind is None:
            raise ValueError(f"the hf engine's requests need attn_implementation sdpa or eager, not {model.config._attn_implementation!r}")
        if kind == "bool":
            return allowed
        dtype = next(model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)

    def _sample(self, logits: torch.Tensor, rows: list[Optional[_Running]]) -> None:
        """(rows, V) logits -> each running row's next token and its logprob at its temperature (of the full
        distribution), appended to it. Every operation covers all rows at once, whatever is running in them."""
        running = [(i, r) for i, r in enumerate(rows) if r is not None]
        how = [r.request.sampling if r is not None else None for r in rows]
        temperature = torch.tensor([[h.temperature if h is not None else 1.0] for h in how], device=logits.device)
        step_logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
        draw_from = step_logprobs
        cuts = [(h.top_k, h.top_p, h.min_p) if h is not None and not h.greedy else None for h in how]
        for cut in set(cuts) - {None, (0, 1.0, 0.0)}:
            these = torch.tensor([[c == cut] for c in cuts], device=logits.device)
            draw_from = torch.where(these, truncate_distribution(step_logprobs, *cut), draw_from)
        noise = torch.ones_like(step_logprobs)
        for i, r in running:
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        probs = draw_from.exp()
        race = torch.where(probs > 0, probs / noise, torch.zeros_like(probs)).argmax(-1)
        greedy = torch.tensor([h is not None and h.greedy for h in how], device=logits.device)
        tokens = torch.where(greedy, step_logprobs.argmax(-1), race)
        chosen = step_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        tokens, chosen = tokens.tolist(), chosen.tolist()
        for i, r in running:
            r.tokens.append(tokens[i])
            r.logprobs.append(chosen[i])


def _generator(request: Request, device: torch.device) -> Optional[torch.Generator]:
    if request.sampling.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(request.seed)
    return generator
