"""The hf engine's requests: a slot decoder whose every forward has one shape, so that a request's tokens and
logprobs do not depend on what else is decoded beside it (continuous batching without batch effects).

Why one shape: a row of a matrix product can change in its last bits with the number of rows beside it (measured
on this project's CPUs: a row of X @ W for a 768 x 3072 weight differs by up to 1e-4 between 3 and 4 rows), and
attention's sums with the padding in front of a row. So:
- decoding: every decoding forward is `slots` rows of one token, one per slot, against `capacity` cached positions
  per slot. A slot's token at position p is written at column p of its own cache (no padding in front of it: its
  real keys are columns 0..p), and a 4-D mask shows each row its own columns 0..p only. What is not a slot's real
  token (an idle slot's, a slot that reads instead) is a placeholder: it is written to the slot's scratch column,
  after the `capacity` real ones, and sees only that column, so it never touches a real key.
- reading a prompt (its tokens, or what follows the request it continues), one of three ways by how many tokens
  it has to read: at most `read_in_steps` (4) in its slot through the decoding forwards, one token per step, beside
  the other slots' decoding (no forward of its own: on CPU a forward's fixed cost is most of a small model's); at
  most `read_together` (16) in one reading forward of `slots` rows of `read_together` tokens, at the end of its
  slot's row beside every other slot that reads then (the rest placeholders), whose last token gives its first
  sample, in the same step as the decoding forward; more, alone (one row, its own length) into a one-row cache,
  then copied into its slot; requests with the same prompt read alone in one step (a group's samples) share that
  read, which is the same computation. Which way a request is read depends on the request alone.
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

from ppokit.engines.base import Sampled, Request
from ppokit.engines.sampling import truncate_distribution
from ppokit.models.forwards import causal_lm_step

# How a request's tokens to read are read, by their number (`SlotDecoder`). Measured on the 2-core CPU machine with
# the multi-turn benchmark's model (64 slots): a reading forward of 16 tokens per slot costs what ~4 decoding forwards
# do, so up to 4 tokens ride along the decoding forwards and up to 16 (a short prompt, a chat turn's observation) are
# read by all the slots that read them at once.
READ_IN_STEPS, READ_TOGETHER = 4, 16

# Attention implementations that read a 4-D mask as given: a boolean mask (sdpa) or an additive one (eager).
MASKED_ATTENTION = {"sdpa": "bool", "eager": "additive"}


class SlotCache(Cache):
    """Keys and values of `rows` sequences, `capacity` positions each and `scratch` columns after them for placeholders:
    per layer (rows, kv heads, width = capacity + scratch, head dim), allocated at the first write. `write_at` (rows,
    q): the column each new key of a forward goes to (set before it; placeholders of a row may share one)."""

    def __init__(self, rows: int, capacity: int, scratch: int = 0):
        super().__init__(layers=[])
        self.rows, self.capacity, self.width = rows, capacity, capacity + scratch
        self._rows: Optional[torch.Tensor] = None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.write_at: Optional[torch.Tensor] = None

    def allocate_like(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Tensors for every layer, shaped as another cache's (their rows and lengths aside)."""
        def blank(t):
            return t.new_zeros((self.rows, t.shape[-3], self.width, t.shape[-1]))

        self.keys, self.values = [blank(k) for k in keys], [blank(v) for v in values]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == len(self.keys):
            self.keys.append(key_states.new_zeros((self.rows, key_states.shape[1], self.width, key_states.shape[-1])))
            self.values.append(value_states.new_zeros((self.rows, value_states.shape[1], self.width, value_states.shape[-1])))
        rows = self._row_index(key_states.device)
        # (rows, q) columns; the indexed result is (rows, q, heads, head dim)
        self.keys[layer_idx][rows, :, self.write_at] = key_states.transpose(1, 2)
        self.values[layer_idx][rows, :, self.write_at] = value_states.transpose(1, 2)
        return self.keys[layer_idx], self.values[layer_idx]

    def _row_index(self, device) -> torch.Tensor:
        """(rows, 1): each row's index, made once (every layer of every forward indexes with it)."""
        if self._rows is None or self._rows.device != device:
            self._rows = torch.arange(self.rows, device=device).unsqueeze(1)
        return self._rows

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are given to every forward; nothing reads this to place tokens

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.width

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.width, 0

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
    """A finished request's keys and values, kept for the request that continues it: left in the slot it ran in
    (columns 0..n-1, n = len(tokens) - 1: its last token was never fed) until another request takes that slot, then
    copied out."""

    tokens: list[int]  # its prompt + completion: what a continuing prompt starts with
    slot: Optional[int] = None  # the free slot they lie in; None: in keys / values
    keys: Optional[list[torch.Tensor]] = None  # per layer (kv heads, n, head dim)
    values: Optional[list[torch.Tensor]] = None


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
    reads_together: bool = False  # its prompt's tokens wait for the next reading forward (not fed by the decoding ones)
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

    def completion(self, reason: str) -> Sampled:
        return Sampled(self.request.request_id, list(self.tokens), list(self.logprobs), reason, self.cached)


class SlotDecoder:
    """Requests decoded in `slots` fixed slots of `capacity` positions (see the module docstring).

    read_in_steps / read_together: a request with at most `read_in_steps` tokens to read (its prompt, or what follows
    the request it continues) reads them through the decoding forwards, one per step, in its slot (default 4); one
    with at most `read_together` (default 16) in one reading forward beside the other slots reading then; a longer one
    alone first. Which way depends on the request alone. pad_token_id: what a placeholder is fed. The model is handed
    to every `step` (the engine's current policy); the caller holds torch.inference_mode and the sampling contexts
    around it.
    """

    def __init__(self, slots: int, capacity: int, pad_token_id: int, device: torch.device, read_in_steps: Optional[int] = None,
                 read_together: Optional[int] = None):
        self.slots, self.capacity, self.pad_token_id, self.device = slots, capacity, pad_token_id, torch.device(device)
        self.read_in_steps = READ_IN_STEPS if read_in_steps is None else read_in_steps
        self.read_together = READ_TOGETHER if read_together is None else read_together
        self.queue: deque[Request] = deque()
        self.running: list[Optional[_Running]] = [None] * slots
        self.kept: dict[str, _Kept] = {}
        self.home: list[Optional[str]] = [None] * slots  # per free slot, the kept request whose keys and values lie in it
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

    def abort(self, request_ids: Iterable[str]) -> list[Sampled]:
        wanted = set(request_ids)
        aborted = [Sampled(r.request_id, [], [], "abort") for r in self.queue if r.request_id in wanted]
        self.queue = deque(r for r in self.queue if r.request_id not in wanted)
        for i, slot in enumerate(self.running):
            if slot is not None and slot.request.request_id in wanted:
                aborted.append(slot.completion("abort"))
                self.running[i] = None
        return aborted

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            kept = self.kept.pop(request_id, None)
            if kept is not None and kept.slot is not None:
                self.home[kept.slot] = None

    def release(self) -> None:
        """Free the caches and everything kept (nothing may be running)."""
        if self.unfinished():
            raise RuntimeError(f"the hf engine has {self.unfinished()} unfinished requests; abort them before training")
        self.kept.clear()
        self.home = [None] * self.slots
        self._decode = self._prefill = self._prefilled = None

    # ------------------------------------------------------------------ decoding

    def step(self, model) -> list[Sampled]:
        """Admit queued requests into free slots (those read alone are read now, their first token sampled), then the
        reading forward (if a slot has tokens to read together), then the decoding forward (if a slot has a token to
        feed) -> the requests that completed."""
        done = []
        self._prefilled = None  # shared only between requests admitted in one step (the weights may change between steps)
        while self.queue:
            slot = self._free_slot(self.queue[0])
            if slot is None:
                break
            finished = self._admit(model, self.queue.popleft(), slot)
            if finished is not None:
                done.append(finished)
        if any(slot is not None and slot.reads_together for slot in self.running):
            done += self._read_step(model)
        if any(slot is not None and not slot.reads_together for slot in self.running):
            done += self._decode_step(model)
        return done

    def _free_slot(self, request: Request) -> Optional[int]:
        """Where `request` goes: the slot that holds what it continues, else a free slot holding nothing kept, else any
        free one (None: none free). Which slot does not change its result: a slot's row never meets another's."""
        kept = self.kept.get(request.continues) if request.continues is not None else None
        if kept is not None and kept.slot is not None:
            return kept.slot  # free: a request taking a slot copies out what it holds (`_admit`)
        free = [i for i, running in enumerate(self.running) if running is None]
        return next((i for i in free if self.home[i] is None), free[0] if free else None)

    def _admit(self, model, request: Request, slot: int) -> Optional[Sampled]:
        """Put `request` in the free `slot`: with what it continues in place or copied in, its prompt to be read in the
        decoding or reading forwards, or read alone now (its first token sampled then) -> its completion if that first
        token already ended it."""
        kept = self.kept.pop(request.continues) if request.continues is not None else None
        if self.home[slot] is not None and (kept is None or kept.slot != slot):
            self._evict(slot)
        self.home[slot] = None
        start = len(kept.tokens) - 1 if kept is not None else 0
        running = _Running(request, _generator(request, self.device), fed=start, cached=start)
        to_read = len(request.prompt) - start
        if to_read <= max(self.read_in_steps, self.read_together):
            if kept is not None and kept.slot != slot:
                self._decode_cache(kept.keys, kept.values).copy_row(_Rows(kept), 0, slot, start)
            running.reads_together = to_read > self.read_in_steps
            self.running[slot] = running
            return None
        if self._prefill is None:
            self._prefill = SlotCache(1, self.capacity)
        prefill = self._prefill
        if kept is not None:
            source, row = (self._decode, slot) if kept.slot == slot else (_Rows(kept), 0)
            if not prefill.allocated:
                prefill.allocate_like(source.keys, source.values)
            prefill.copy_row(source, row, 0, start)
        prompt = tuple(request.prompt)
        if kept is None and self._prefilled is not None and self._prefilled[0] == prompt:
            logits = self._prefilled[1]  # the prompt the prefill row holds already (a group's samples): the same bits
        else:
            new = torch.tensor([list(request.prompt[start:])], dtype=torch.long, device=self.device)
            positions = torch.arange(start, len(request.prompt), device=self.device).unsqueeze(0)
            prefill.write_at = positions
            logits, _ = causal_lm_step(model, new, self._mask(model, positions, prefill.width), positions, cache=prefill, logits_to_keep=1)
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

    def _slots_cache(self) -> SlotCache:
        """The slots' cache: `capacity` columns per slot and one scratch column for placeholders."""
        if self._decode is None:
            self._decode = SlotCache(self.slots, self.capacity, scratch=1)
        return self._decode

    def _decode_cache(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> SlotCache:
        """The slots' cache, allocated like `keys` / `values` if no forward has made it yet."""
        cache = self._slots_cache()
        if not cache.allocated:
            cache.allocate_like(keys, values)
        return cache

    def _read_step(self, model) -> list[Sampled]:
        """One reading forward: `slots` rows of `read_together` tokens, each slot that reads together its tokens to
        read at the end of its row (placeholders before them, and in every other row), so that the row's last column,
        the only one whose logits are made (a vocabulary's worth per row, not per token), gives its first sample."""
        width = self.read_together
        reading = [slot if slot is not None and slot.reads_together else None for slot in self.running]
        tokens = [[self.pad_token_id] * width for _ in reading]
        positions = [[0] * width for _ in reading]
        real = [[False] * width for _ in reading]
        for i, slot in enumerate(reading):
            if slot is not None:
                new = slot.request.prompt[slot.fed:]
                tokens[i][width - len(new):] = new
                positions[i][width - len(new):] = range(slot.fed, slot.fed + len(new))
                real[i][width - len(new):] = [True] * len(new)
                slot.fed, slot.reads_together = len(slot.request.prompt), False
        logits = self._forward(model, tokens, positions, real, logits_to_keep=1)
        return self._sampled(logits[:, -1], reading)

    def _decode_step(self, model) -> list[Sampled]:
        """One decoding forward of every slot: each running request's next token in (a prompt token or the last it
        sampled); the slots that read together are placeholders in it."""
        feeding = [slot if slot is not None and not slot.reads_together else None for slot in self.running]
        tokens = [[slot.next_input() if slot is not None else self.pad_token_id] for slot in feeding]
        positions = [[slot.fed if slot is not None else 0] for slot in feeding]
        for slot in feeding:
            if slot is not None:
                slot.fed += 1
        logits = self._forward(model, tokens, positions, [[slot is not None] for slot in feeding], logits_to_keep=1)
        return self._sampled(logits[:, -1], [slot if slot is not None and slot.samples else None for slot in feeding])

    def _forward(self, model, tokens: list[list[int]], positions: list[list[int]], real: list[list[bool]], logits_to_keep: int) -> torch.Tensor:
        """One forward of every slot, (slots, q) tokens at their positions into the slots' cache, where `real`; the
        placeholders into the scratch column (which of a row's placeholders is left there does not matter: only
        placeholders see it) -> logits (slots, logits_to_keep, V)."""
        tokens, positions = (torch.tensor(t, dtype=torch.long, device=self.device) for t in (tokens, positions))
        real = torch.tensor(real, dtype=torch.bool, device=self.device)
        cache = self._slots_cache()
        cache.write_at = torch.where(real, positions, self.capacity)
        columns = torch.arange(cache.width, device=self.device)
        sees = torch.where(real.unsqueeze(-1), (columns <= positions.unsqueeze(-1)), columns == cache.write_at.unsqueeze(-1))
        logits, _ = causal_lm_step(model, tokens, self._as_mask(model, sees), positions, cache=cache, logits_to_keep=logits_to_keep)
        if not cache.allocated:
            raise ValueError("the hf engine's requests need a model whose layers cache keys and values (full attention)")
        return logits

    def _sampled(self, logits: torch.Tensor, sampling: list[Optional[_Running]]) -> list[Sampled]:
        """(slots, V) logits -> the next token of each slot in `sampling` (None: not sampled) -> the requests it completed."""
        self._sample(logits, sampling)
        done = []
        for i, slot in enumerate(sampling):
            reason = slot.finish_reason() if slot is not None else None
            if reason is not None:
                self._finish(slot, self._decode, i)
                done.append(slot.completion(reason))
                self.running[i] = None
        return done

    def _finish(self, running: _Running, cache: SlotCache, row: int) -> None:
        """Keep a finished request's keys and values (every token it fed) when it asked to be continued: in its slot
        (`cache` the slots'), or copied out of the prefill row."""
        if running.request.keep:
            request_id = running.request.request_id
            self.kept[request_id] = kept = _Kept(list(running.request.prompt) + running.tokens)
            if cache is self._decode:
                kept.slot, self.home[row] = row, request_id
            else:
                self._copy_out(kept, cache, row)

    def _evict(self, slot: int) -> None:
        """The kept keys and values lying in free `slot` copied out of it, before another request takes it."""
        kept = self.kept[self.home[slot]]
        self._copy_out(kept, self._decode, slot)
        kept.slot, self.home[slot] = None, None

    @staticmethod
    def _copy_out(kept: _Kept, cache: SlotCache, row: int) -> None:
        """Copy a kept request's keys and values (columns 0..n-1) out of `cache`'s `row`."""
        n = len(kept.tokens) - 1
        kept.keys = [k[row, :, :n].clone() for k in cache.keys]
        kept.values = [v[row, :, :n].clone() for v in cache.values]

    def _mask(self, model, positions: torch.Tensor, width: int) -> torch.Tensor:
        """(rows, q) positions of real tokens -> their mask: each query sees its own row's columns up to its position."""
        return self._as_mask(model, torch.arange(width, device=positions.device) <= positions.unsqueeze(-1))

    @staticmethod
    def _as_mask(model, sees: torch.Tensor) -> torch.Tensor:
        """(rows, q, width) which columns each query sees -> the 4-D mask (rows, 1, q, width) as the model's attention
        takes it (boolean for sdpa, additive for eager)."""
        allowed = sees.unsqueeze(1)
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
