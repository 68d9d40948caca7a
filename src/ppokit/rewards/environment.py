"""The environment as a reward source: each episode's summed step rewards, scored like any other source; and
`EnvironmentFailure`, what a failed environment call is (environments/base.py raises it, this source passes it on)."""

from __future__ import annotations

import torch

from ppokit.rewards.sources import RewardError


class EnvironmentFailure(RewardError):
    """An environment call raised, timed out or returned something malformed: that episode failed.
    A RewardError, so `reward.on_error: skip` drops the episode and `raise` stops the run."""


class EnvironmentReward:
    """The environment as a reward source (`reward/environment`): each episode's summed step rewards.
    An episode whose environment failed fails here, with the environment's own one-line message, so
    `reward.on_error` applies to it as to any source (skip: that episode leaves the update)."""

    name = "environment"

    def __init__(self, name: str = "environment"):
        self.name = name  # "agent": an agent program's returned rewards (`reward/agent`), carried as an environment's are

    def score(self, batch) -> torch.Tensor:
        if batch.environment_rewards is None:
            raise EnvironmentFailure("the environment reward source was given a batch without environment rewards")
        failed = [error for error in batch.environment_errors or [] if error]
        if failed:
            raise EnvironmentFailure(failed[0])
        return torch.tensor(batch.environment_rewards, dtype=torch.float32)
