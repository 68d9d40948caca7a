"""The rollout: stages 1 and 2 of an update, for any purpose. Episodes are sampled for prompts by the run's
episode loop over the rollout engine (`environments.episode_loop`: one turn per prompt, or multi-turn episodes with an
environment) and scored by its reward sources (`experience.score`). Multi-turn episodes are seeded by (run seed,
update, row, turn) (`EpisodeSeeds`; the purpose too, for eval and greedy).

    train    the update's episodes (ppo.temperature, top_k / top_p / min_p); scoring moves the reward normalisation
    eval     evaluate() and the sample generations (ppo.eval_temperature; 0: greedy); scored without moving it
    greedy   the baseline of an estimator with `greedy_baseline` (ReMax): the most likely token at every step

The engine is held here once, by the episode source (`engine`).
"""

from __future__ import annotations

import copy
from typing import Callable, Optional

import torch

from ppokit.training import experience
from ppokit.engines.base import Sampling
from ppokit.environments.conversation import Conversation
from ppokit.environments.episode_loop import EpisodeSeeds, data_rows, episode_source
from ppokit.training.episodes import Episodes


class Rollout:
    """Sampling and scoring for the trainer, its evaluation and its greedy baselines.

    engine: the rollout engine (`engines.base.RolloutEngine`) and conversation (`environments.conversation.Conversation`), which the
    episode source samples over (`episode_loop.episode_source`, with max_turns, max_episode_tokens, max_concurrent,
    pad_token_id: its keys); scorer: the reward sources (`rewards.RewardScorer`); tokenizer: the policy's (completions
    are decoded with it); sampling: each purpose's (`engines.base.Sampling.by_purpose`); what ends a response is the
    conversation's `stop_token_ids` (any of them); device: where episodes and scores go; reduce: a sum over processes; seed: the
    run's (the episodes' seeds); process_index: this process's (its rows' numbers among every process's).
    """

    def __init__(self, engine, conversation: Conversation, scorer, tokenizer, sampling: dict[str, Sampling], *, max_turns: int, max_episode_tokens: int,
                 max_concurrent: Optional[int], pad_token_id: int, device: torch.device,
                 reduce: Callable[[torch.Tensor], torch.Tensor], seed: int = 0, process_index: int = 0):
        self.source = episode_source(engine, conversation, max_turns=max_turns, max_episode_tokens=max_episode_tokens,
                                     max_concurrent=max_concurrent, pad_token_id=pad_token_id, device=device)
        self.scorer, self.tokenizer, self.sampling = scorer, tokenizer, sampling
        self.stop_token_ids, self.device, self.reduce = conversation.stop_token_ids, device, reduce
        self.seed, self.process_index = seed, process_index
        self.environments = conversation.runner.environment_names if conversation.runner is not None else []

    @property
    def engine(self):
        """The rollout engine (`engines.base.RolloutEngine`)."""
        return self.source.engine

    def over(self, engine) -> "Rollout":
        """This rollout sampling with `engine` in place of its own (`sampler.SeededEngine`, for batches sampled ahead)."""
        other = copy.copy(self)
        other.source = copy.copy(self.source)
        other.source.engine = engine
        return other

    def sample(self, query_ids: list[list[int]], prompts: list[str], columns: dict, purpose: str = "train",
               update: Optional[int] = None) -> Episodes:
        """One response per query by the rollout engine, or with an `environment` a multi-turn episode over it (what it
        said in the episodes too), the data rows (`prompts`, `columns`) given to its reset. update: the update the
        episodes are for (their seeds: `EpisodeSeeds`, this process's rows numbered after the processes' before it);
        None: seeds drawn from torch's generator."""
        seeds = None if update is None else EpisodeSeeds(self.seed, update, purpose, first_row=self.process_index * len(query_ids))
        return self.source.sample(query_ids, data_rows(prompts, columns), self.sampling[purpose], seeds)

    def score(self, episodes: Episodes, prompts: list[str], columns: dict, update_statistics: bool = True) -> experience.Scored:
        """The reward sources on the episodes (`experience.score`)."""
        return experience.score(self.scorer, self.tokenizer, episodes, prompts, columns, stop_token_ids=self.stop_token_ids,
                                device=self.device, update_statistics=update_statistics, all_reduce=self.reduce,
                                environments=self.environments)

    def sample_and_score(self, data, query_ids: list[list[int]], rows, purpose: str,
                         update: Optional[int] = None) -> tuple[Episodes, experience.Scored]:
        """Episodes for prompts `rows` of `data` (query_ids: its token ids) sampled for `purpose` (update: `sample`'s),
        and what scoring found, scored without moving the reward normalisation."""
        prompts, columns = data.rows(rows)
        episodes = self.sample([query_ids[i] for i in rows], prompts, columns, purpose, update)
        return episodes, self.score(episodes, prompts, columns, update_statistics=False)

    def greedy_baseline(self, data, query_ids: list[list[int]], indices: list[int], samples_per_prompt: int,
                        update: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The baseline of an estimator with `greedy_baseline` (ReMax): the score of one greedy response to each prompt
        `indices` of `data` (for update `update`), repeated for its n samples -> (scores (B,), valid (B,) bool)."""
        _, scored = self.sample_and_score(data, query_ids, indices, "greedy", update)
        return scored.scores.repeat_interleave(samples_per_prompt), scored.valid.repeat_interleave(samples_per_prompt)
