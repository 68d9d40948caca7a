"""The `hf` rollout engine: sampling from the training weights themselves with transformers' KV cache
(`HFSampler`) into Episodes, so its logprobs are the training forward's and there is nothing to sync or release."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional, Sequence, Union

import torch
from torch import nn

from ppokit import algo
from ppokit.engines.base import EngineMemory, EngineSetup, EngineSizing, Sampling, step_logits_bytes
from ppokit.episodes import Episodes
from ppokit.models import causal_lm_step, eval_mode, left_pad, position_ids_from_mask


# Rows that have produced the stop token leave the forward batch every this many decoding steps (the
# trainer's setting; measured on the variable-shape benchmark: ~10% less sampling time, same tokens).
COMPACT_FINISHED_ROWS_EVERY = 8


class HFEngine:
    """A `RolloutEngine` around `HFSampler`: the policy in eval mode (no dropout), under `sampling_contexts`
    (the parallel strategy's and the training forward's precision: the first PPO ratio is 1), back in train mode after.

    policy: the policy module, or a function returning the current one. pad_token_id: left-pads the prompts.
    rows_per_forward: rows per sampling forward. logprobs_are_trainers: what the engine declares (True: the
    sampled logprobs are the training forward's); False makes the trainer recompute them as for an external
    engine (a test of that path with an engine whose answer is known).
    """

    def __init__(self, policy: Union[nn.Module, Callable[[], nn.Module]], pad_token_id: int, device: torch.device,
                 rows_per_forward: int, sampling_contexts: Optional[Callable[[nn.Module], Sequence[ContextManager]]] = None,
                 logprobs_are_trainers: bool = True):
        self._policy = policy
        self.pad_token_id = pad_token_id
        self.device = device
        self.rows_per_forward = rows_per_forward
        self.sampling_contexts = sampling_contexts or (lambda policy: ())
        self.logprobs_are_trainers = logprobs_are_trainers

    @classmethod
    def create(cls, setup: EngineSetup) -> "HFEngine":
        return cls(setup.policy, setup.pad_token_id, setup.device, setup.rows_per_forward, setup.sampling_contexts)

    @property
    def policy(self) -> nn.Module:
        return self._policy if isinstance(self._policy, nn.Module) else self._policy()

    def generate(self, prompts: list[list[int]], sampling: Sampling):
        ids, mask = left_pad(prompts, self.pad_token_id, self.device)
        policy = self.policy
        sampler = HFSampler(policy, sampling.max_new_tokens, sampling.temperature, sampling.stop_token_id, self.pad_token_id,
                            self.rows_per_forward, top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p,
                            greedy=sampling.greedy, compact_every=COMPACT_FINISHED_ROWS_EVERY)
        with eval_mode(policy), contextlib.ExitStack() as inside:
            for context in self.sampling_contexts(policy):
                inside.enter_context(context)
            return sampler.sample(ids, mask)

    def sync_weights(self, policy: nn.Module) -> None:
        """Nothing to push: sampling reads the training weights."""

    def release(self) -> None:
        """Nothing held between rollouts: the KV cache lives for one `generate`."""

    def resume(self) -> None:
        pass

    def close(self) -> None:
        pass

    @staticmethod
    def check_installed() -> None:
        """transformers and torch are ppokit's own dependencies."""

    @staticmethod
    def check(model_config, settings, model_name: str) -> None:
        """Any causal LM transformers loads, with any `rollout:` keys of its own (none)."""

    @staticmethod
    def memory(sizing: EngineSizing) -> EngineMemory:
        """Nothing held of its own (it samples from the training weights, counted apart); while sampling
        rows_per_forward sequences of up to longest_sequence tokens: keys and values of every layer at the
        activations' width, and one step's float32 logits and their log-softmax (`step_logits_bytes`)."""
        dims, rows = sizing.dims, sizing.rows_per_forward
        kv_cache = 2 * dims["layers"] * dims["kv"] * rows * sizing.longest_sequence * sizing.act_bytes
        return EngineMemory(sampling=kv_cache + step_logits_bytes(rows, dims["vocab"]))


@dataclass
class HFSampler:
    """Batched ancestral sampling from a transformers causal LM with its KV cache.

    Tokens are drawn from the softmax of logits / temperature, truncated by top_k / top_p / min_p
    when they are set (`truncate_distribution`; all off by default, as in the reference
    implementations), or taken greedily (`greedy`, the argmax). Stops as soon as every row has
    produced the stop token. The logprobs kept are those of the full softmax at the temperature,
    not of the truncated distribution: they are what the training forward computes, so the PPO
    ratio on the first minibatch is 1 and the KL is the policy's own. Kept from sampling, they
    need no second policy forward: with dropout off they equal a fresh forward's.
    """

    model: torch.nn.Module
    response_length: int
    temperature: float
    stop_token_id: Optional[int]
    pad_token_id: int
    batch_size: int = 64
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    greedy: bool = False  # argmax instead of sampling (evaluation at temperature 0, ReMax's baseline)
    # Every this many steps, rows that produced the stop token leave the forward batch (and the KV
    # cache); 0: they stay to the end, fed padding. The sampled tokens are the same either way.
    compact_every: int = 0

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
        if self.stop_token_id is not None:
            response_ids, response_mask = algo.truncate_after_stop(response_ids, self.stop_token_id, self.pad_token_id)
            ended = (response_ids == self.stop_token_id).any(1)
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
        next_position = positions[:, -1:] + 1
        done = torch.zeros(rows, dtype=torch.bool, device=query_ids.device)
        active = None  # rows still in the forward batch, once finished rows have been dropped from it
        tokens, logprobs = [], []
        for step in range(self.response_length):
            step_logprobs = torch.log_softmax(logits[:, -1].float() / self.temperature, dim=-1)
            if active is not None:
                step_logprobs = _with_placeholder_rows(step_logprobs, active, rows)
            token = self._choose(step_logprobs)
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

    def _choose(self, step_logprobs: torch.Tensor) -> torch.Tensor:
        """(rows, V) logprobs at the temperature -> (rows,) next tokens."""
        if self.greedy:
            return step_logprobs.argmax(-1)
        if self.top_k or self.top_p < 1 or self.min_p > 0:
            step_logprobs = truncate_distribution(step_logprobs, self.top_k, self.top_p, self.min_p)
        return torch.multinomial(step_logprobs.exp(), 1).squeeze(1)


def truncate_distribution(logprobs: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The sampling distribution cut down by top-k, then top-p (nucleus), then min-p, in the order
    transformers' logits processors apply them; each cut acts on the distribution the one before left.

    logprobs: (rows, V) log-probabilities -> (rows, V) log-probabilities of the kept tokens,
    renormalised, -inf elsewhere. The most likely token is always kept.
      top_k > 0:  the k most likely tokens (ties at the k-th are kept);
      top_p < 1:  the smallest set of most likely tokens whose probability reaches top_p
                  [Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"];
      min_p > 0:  the tokens with p >= min_p * p_max [Nguyen et al. 2024, "Turning Up the Heat:
                  Min-p Sampling for Creative and Coherent LLM Outputs"].
    """
    cut = float("-inf")
    if top_k > 0 and top_k < logprobs.shape[-1]:
        kth = logprobs.topk(top_k, dim=-1).values[:, -1:]
        logprobs = logprobs.masked_fill(logprobs < kth, cut)
    if top_p < 1.0:
        ordered, order = logprobs.sort(dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        mass_before = probs.cumsum(-1) - probs  # what the more likely tokens already cover
        drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, order, mass_before >= top_p)
        logprobs = logprobs.masked_fill(drop, cut)
    if min_p > 0.0:
        probs = torch.softmax(logprobs, dim=-1)
        logprobs = logprobs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, cut)
    return torch.log_softmax(logprobs, dim=-1)


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
