"""Sampling responses with the KV cache, and the Rollout container that carries them through an update."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from ppokit import algo
from ppokit.models import causal_lm_step, position_ids_from_mask


@dataclass
class Rollout:
    """One batch of episodes. B sequences, P prompt tokens (left-padded), R response tokens.

    Filled in stages by the trainer: sampling fills the first six fields; scoring `scores`;
    the reference and value passes `ref_logprobs` and `values`; shaping and GAE the rest.
    """

    query_ids: torch.Tensor  # (B, P) long, left-padded with pad_token_id
    query_mask: torch.Tensor  # (B, P) bool, True on real prompt tokens
    response_ids: torch.Tensor  # (B, R) long, pad_token_id after the stop token
    response_mask: torch.Tensor  # (B, R) bool, True up to and including the stop token
    logprobs: torch.Tensor  # (B, R) float, sampling policy's logprobs (logits / temperature)
    ended: torch.Tensor  # (B,) bool, True where the response contains the stop token
    ref_logprobs: Optional[torch.Tensor] = None  # (B, R) float, reference policy's logprobs
    values: Optional[torch.Tensor] = None  # (B, R) float, value of the state before each token
    scores: Optional[torch.Tensor] = None  # (B,) float, combined reward-source score per sequence
    rewards: Optional[torch.Tensor] = None  # (B, R) float, per-token reward (KL penalty + score)
    advantages: Optional[torch.Tensor] = None  # (B, R) float, GAE advantages (whitened if configured)
    returns: Optional[torch.Tensor] = None  # (B, R) float, value targets

    @property
    def input_ids(self) -> torch.Tensor:
        """(B, P + R) prompt and response."""
        return torch.cat([self.query_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """(B, P + R) long."""
        return torch.cat([self.query_mask, self.response_mask], dim=1).long()

    def select(self, index: torch.Tensor) -> "Rollout":
        """Rows `index` of every filled field."""
        picked = {f.name: (getattr(self, f.name)[index] if getattr(self, f.name) is not None else None) for f in fields(self)}
        return Rollout(**picked)

    def __len__(self) -> int:
        return self.query_ids.shape[0]


# Rows that have produced the stop token leave the forward batch every this many decoding steps (the
# trainer's setting; measured on the variable-shape benchmark: ~10% less sampling time, same tokens).
COMPACT_FINISHED_ROWS_EVERY = 8


@dataclass
class HFSampler:
    """Batched ancestral sampling from a transformers causal LM with its KV cache.

    Temperature only (top-k and top-p off, as in the reference implementations); stops as soon
    as every row has produced the stop token. Logprobs are kept from sampling, so no second
    policy forward is needed: with dropout off they equal a fresh forward's.
    """

    model: torch.nn.Module
    response_length: int
    temperature: float
    stop_token_id: Optional[int]
    pad_token_id: int
    batch_size: int = 64
    # Every this many steps, rows that produced the stop token leave the forward batch (and the KV
    # cache); 0: they stay to the end, fed padding. The sampled tokens are the same either way.
    compact_every: int = 0

    @torch.inference_mode()
    def sample(self, query_ids: torch.Tensor, query_mask: torch.Tensor) -> Rollout:
        chunks = [
            self._sample_chunk(query_ids[i : i + self.batch_size], query_mask[i : i + self.batch_size])
            for i in range(0, query_ids.shape[0], self.batch_size)
        ]
        width = max(c[0].shape[1] for c in chunks)
        pad = lambda t, v: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=v)  # noqa: E731
        response_ids = torch.cat([pad(c[0], self.pad_token_id) for c in chunks])
        logprobs = torch.cat([pad(c[1], 0.0) for c in chunks])
        if self.stop_token_id is not None:
            response_ids, response_mask = algo.truncate_after_stop(response_ids, self.stop_token_id, self.pad_token_id)
            ended = (response_ids == self.stop_token_id).any(1)
        else:
            response_mask = torch.ones_like(response_ids, dtype=torch.bool)
            ended = torch.zeros(response_ids.shape[0], dtype=torch.bool, device=response_ids.device)
        rollout = Rollout(
            query_ids=query_ids,
            query_mask=query_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            logprobs=logprobs.masked_fill(~response_mask, 0.0),
            ended=ended,
        )
        return rollout

    def _sample_chunk(self, query_ids, query_mask):
        rows = query_ids.shape[0]
        attention_mask = query_mask.long()
        positions = position_ids_from_mask(attention_mask)
        logits, cache = causal_lm_step(self.model, query_ids, attention_mask, positions, logits_to_keep=1)
        next_position = positions[:, -1:] + 1
        done = torch.zeros(rows, dtype=torch.bool, device=query_ids.device)
        active = None  # rows still in the forward batch, once finished rows have been dropped from it
        tokens, logprobs = [], []
        for step in range(self.response_length):
            step_logprobs = torch.log_softmax(logits[:, -1].float() / self.temperature, dim=-1)
            if active is not None:
                step_logprobs = _with_placeholder_rows(step_logprobs, active, rows)
            token = torch.multinomial(step_logprobs.exp(), 1).squeeze(1)
            token = token.masked_fill(done, self.pad_token_id)
            tokens.append(token)
            logprobs.append(step_logprobs.gather(1, token.unsqueeze(1)).squeeze(1))
            if self.stop_token_id is not None:
                done |= token == self.stop_token_id
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
            logits, cache = causal_lm_step(self.model, step_tokens.unsqueeze(1), attention_mask, next_position, cache=cache)
            next_position = next_position + 1
        return torch.stack(tokens, 1), torch.stack(logprobs, 1)


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
