"""The `hf` rollout engine: sampling from the training weights themselves with transformers' KV cache
(`HFSampler`), so its logprobs are the training forward's and there is nothing to sync or release."""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional, Sequence, Union

import torch
from torch import nn

from ppokit.engines.base import EngineSetup, Sampling
from ppokit.models import eval_mode, left_pad
from ppokit.rollout import COMPACT_FINISHED_ROWS_EVERY, HFSampler


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
    def sampling_bytes(dims: dict, rows: int, seq: int, act_bytes: int) -> int:
        """Memory while sampling `rows` sequences of up to `seq` tokens (`ppokit plan`'s model dimensions
        `dims`: layers, kv = key/value heads x head_dim, vocab): keys and values of every layer at the
        activations' width, and two float32 rows of logits over the vocabulary per sequence (the last
        position's logits and their log-softmax). The weights are the training ones, counted apart."""
        return 2 * dims["layers"] * dims["kv"] * rows * seq * act_bytes + 2 * rows * dims["vocab"] * 4
