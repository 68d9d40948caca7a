"""The environment as a reward source: each episode's summed step rewards, scored like any other source."""

from __future__ import annotations

import torch


class EnvironmentReward:
    """The environment as a reward source (`reward/environment`): each episode's summed step rewards.
    An episode whose environment failed fails here, with the environment's own one-line message, so
    `reward.on_error` applies to it as to any source (skip: that episode leaves the update)."""

    name = "environment"

    def __init__(self, name: str = "environment"):
        self.name = name  # "agent": an agent program's returned rewards (`reward/agent`), carried as an environment's are

    def score(self, batch) -> torch.Tensor:
        from ppokit.environments.base import EnvironmentFailure

        if batch.environment_rewards is None:
            raise EnvironmentFailure("the environment reward source was given a batch without environment rewards")
        failed = [error for error in batch.environment_errors or [] if error]
        if failed:
            raise EnvironmentFailure(failed[0])
        return torch.tensor(batch.environment_rewards, dtype=torch.float32)
