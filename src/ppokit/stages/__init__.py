"""The training stages run from the command line: `ppokit sft`, `ppokit rm`, `ppokit pipeline`,
and `ppokit data inspect`. PPO itself is `ppokit.trainer.PPOTrainer`."""
