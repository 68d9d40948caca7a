"""A PPO update and what it is made of: the parts built at set-up, the rollout and its off-policy schedule, the stages between sampling and optimising, the
optimiser loop, evaluation, the guards around an update, the saving bookkeeping (a checkpoint once per update, final/, resume), the mathematics (algo)
and the estimators; also the SFT loop."""
