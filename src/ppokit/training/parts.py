"""A run's parts: everything a PPO run is made of, built once from its config before the first update (`assemble`),
in one object that the update, the evaluation and the saving read (`Parts`). Nothing here reads the trainer.

`assemble` builds them in an order that fails early and cheaply:
    1. the run's own config (a validated copy), the seed
    2. every refusal that needs no weights (`startup.prepare`, which `ppokit plan` runs too): what the config needs of
       this machine, the prompts (a bad file fails before any weights load), the tokenizer, the batch arithmetic with
       the learning-rate schedule (`sizes`), the output folder's check, the conversation (the stop token, the
       environment made, the chat template checked against it, a tool-calling turn's own stop token added, chat
       prompts rendered with its tools), the prompts' token ids, the token budget, the reward functions checked;
       then the accelerator and the parallel strategy
    3. the reward sources (`scorer`: the reward model loads), which model plays which role (`layout`), the pad id,
       every prompt's fit
    4. the models: policy and critic under one trainable module with its optimiser and schedule, the frozen reference
       (and teacher)
    5. the rollout engine, what samples the episodes over it and scores them (`rollout`), the KL controller
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from accelerate.utils import set_seed
from torch import nn

from ppokit import engines

from ppokit.models import roles

from ppokit.process import parallel

from ppokit.training import batch_sizes
from ppokit.config.schema import PPOConfig
from ppokit.engines.base import Sampling
from ppokit.environments.conversation import Conversation
from ppokit.process.launcher import launched_processes, launched_rank
from ppokit.models.loading import check_prompts_fit, input_pad_id, position_limit, tightest
from ppokit.training.optimise import prepare_training
from ppokit.data.prompts import PromptDataset
from ppokit.rewards.environment import EnvironmentReward
from ppokit.rewards import RewardScorer, build_scorer, source_label
from ppokit.training.rollout import Rollout
from ppokit.training.startup import prepare
from ppokit.training.token_rewards import kl_controller


@dataclass
class Parts:
    """What `assemble` built. `model` is the trainable module (policy + critic, as the strategy wrapped it; `policy` and
    `value_model` are under it); `sizes` is replaced when a resumed run continues to another length."""

    config: PPOConfig  # the run's own copy (data.chat_template: the template used)
    accelerator: Any
    strategy: Any  # parallel.Replicated or parallel.Sharded
    say: Callable[[str], None]  # a notice for the user: stderr, main process only
    show_progress: bool
    sizes: batch_sizes.BatchSizes
    train_data: PromptDataset
    eval_data: Optional[PromptDataset]
    tokenizer: Any
    conversation: Conversation  # the chat template used, the renderer with the tools' schemas, the environment's runner
    train_query_ids: list[list[int]]
    eval_query_ids: Optional[list[list[int]]]
    stop_token_ids: tuple[int, ...]  # what ends a model turn (any of them), decided by the conversation
    pad_id: int  # what pads every model input (not text)
    scorer: RewardScorer
    layout: roles.RoleLayout
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    ref_model: Optional[nn.Module]  # None: the LoRA policy's base with its adapters off
    rollout: Rollout
    turn_weight: Optional[float]  # rollout.turn_rewards: the environment's weight in reward.weights; None: off
    kl_controller: Any
    reduce: Callable[[torch.Tensor], torch.Tensor]  # a sum over processes
    teacher: Optional[nn.Module] = None  # the frozen teacher of on-policy distillation (config.teacher); None: off

    @property
    def policy(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model).policy

    @property
    def value_model(self) -> Optional[nn.Module]:
        return self.accelerator.unwrap_model(self.model).value_model

    @property
    def rollout_engine(self):
        return self.rollout.engine


def assemble(config: PPOConfig, *, model=None, tokenizer=None, ref_model=None, value_model=None, reward_model=None,
             reward_tokenizer=None, reward_functions: Optional[Sequence[Callable | str]] = None, train_dataset=None,
             eval_dataset=None, accelerator=None, show_progress: bool = True, overwrite: bool = False) -> Parts:
    """The run's parts from `config` and the objects passed in its place (`PPOTrainer`'s arguments, which it documents)."""
    config = run_config(config, model, reward_model, reward_functions)
    if accelerator is None:  # the processes the accelerator will see (`launcher.check_world_size`), before it exists
        processes, main_process = launched_processes(), launched_rank() == 0
    else:
        processes, main_process = accelerator.num_processes, accelerator.is_main_process
    show_progress = show_progress and main_process
    say = (lambda message: print(f"ppokit: {message}", file=sys.stderr)) if show_progress else (lambda message: None)
    set_seed(config.seed)
    # Every refusal that needs no weights, as `ppokit plan` checks them, this machine's first (the main process checks
    # the run folder); then the accelerator, for the switches this machine has
    start = prepare(config, processes=processes, check_folder=main_process, overwrite=overwrite, say=say, model=model,
                    tokenizer=tokenizer, reward_model_given=reward_model is not None, reward_functions=reward_functions,
                    train_dataset=train_dataset, eval_dataset=eval_dataset)
    accelerator = accelerator or parallel.make_accelerator(config.parallel, roles.mixed_precision(config))
    strategy = parallel.strategy(config.parallel, accelerator, bf16=config.bf16)
    reduce = parallel.sum_over_processes(accelerator)
    train_data, eval_data, tokenizer, sizes = start.train_data, start.eval_data, start.tokenizer, start.sizes
    conversation, train_query_ids, eval_query_ids = start.conversation, start.train_query_ids, start.eval_query_ids
    stop_token_ids = conversation.stop_token_ids  # decided once: ppo.stop_token, and a tool-calling turn's own token
    if conversation.template is not None:
        config.data.chat_template = conversation.template  # the run's config records the template used
    limit, room = config.data.max_prompt_length, config.response_room  # room: tokens after the prompt

    scorer = build_scorer(
        config.reward, missing_eos_penalty=config.ppo.missing_eos_penalty, reward_model=reward_model, reward_tokenizer=reward_tokenizer,
        trust_remote_code=config.trust_remote_code, all_reduce=reduce if accelerator.num_processes > 1 else None,
        load_kwargs=roles.load_kwargs(config), verdict=parallel.stop_together(accelerator), checked=start.rewards,
        environment=EnvironmentReward("agent" if config.agent is not None else "environment") if config.episodes_answered else None,
        reward_model_by_tokens=config.ppo.max_tokens_per_micro_batch is not None, reward_model_padding_free=config.ppo.padding_free,
    )
    reward_vocabulary = None if scorer.reward_model is None else scorer.reward_model_shares_vocabulary(tokenizer)
    layout = roles.decide_roles(config, reward_vocabulary=reward_vocabulary, ref_model_given=ref_model is not None,
                                value_model_given=value_model is not None)
    given = dict(model=model, ref_model=ref_model, value_model=value_model)
    readers = roles.configs_reading_policy_ids(layout, config, scorer, reward_vocabulary, **given)
    pad_id = input_pad_id(tokenizer, readers.values())
    positions = tightest(position_limit(reader, role) for role, reader in readers.items())
    check_prompts_fit(readers, positions, [("data.train", train_data, train_query_ids), ("data.eval", eval_data, eval_query_ids)],
                      room, limit, tokenizer, stop_token_ids)

    # What trains, once every start-up check has passed and before the weights load (a TRL GRPO config translated without
    # ppo.advantage_estimator once trained GAE with a critic unsaid): the run's first lines.
    say(f"ppo.advantage_estimator: {config.ppo.estimator.name} ({config.ppo.estimator.doc})")
    if layout.has_critic:
        own = f" {config.value_model}" if layout.critic == roles.CRITIC_OWN and config.value_model else ""
        say(f"value model (the critic): {layout.critic}{own}" + (", training a LoRA adapter" if layout.critic_adapter else ""))
    built = roles.build_roles(layout, config, scorer, **given)
    trained, optimizer, scheduler = prepare_training(built, strategy, config.ppo, sizes, lm_head_chunk_size=config.lm_head_chunk_size,
                                                     compile=config.compile, unwrap=accelerator.unwrap_model)
    if scorer.reward_model is not None:
        strategy.place_frozen(scorer.reward_model).eval()
    reference, teacher = (strategy.place_frozen(m).eval() if m is not None else None for m in (built.reference, built.teacher))

    longest = max(map(len, train_query_ids + (eval_query_ids or [])))
    if conversation.agent is not None:  # an agent's calls bring their own prompts: the engine holds the longest one may have
        longest = max(longest, conversation.agent.prompt_limit(config.data.max_prompt_length, positions and positions.tokens, room, longest))
    engine = engines.build(config.rollout.engine, engines.EngineSetup(
        lambda: accelerator.unwrap_model(trained).policy, pad_id, accelerator.device, config.ppo.local_rollout_forward_batch_size,
        lambda policy: (strategy.generation(policy), accelerator.autocast()), config.rollout,
        longest_sequence=longest + room, rows_per_rollout=sizes.local_batch,
        seed=config.seed))
    sampling = Sampling.by_purpose(config.ppo, stop_token_ids)  # train, eval, greedy
    rollout = Rollout(engine, conversation, scorer, tokenizer, sampling, max_turns=config.rollout.max_turns, max_episode_tokens=room,
                      max_concurrent=config.rollout.max_concurrent_episodes, pad_token_id=pad_id,
                      device=accelerator.device, reduce=reduce, seed=config.seed, process_index=accelerator.process_index)
    return Parts(
        config, accelerator, strategy, say, show_progress, sizes, train_data, eval_data, tokenizer, conversation, train_query_ids,
        eval_query_ids, stop_token_ids, pad_id, scorer, layout, trained, optimizer, scheduler, reference, rollout,
        config.turn_weight, kl_controller(config.ppo.kl_coef, config.ppo.kl_target, config.ppo.kl_horizon), reduce, teacher,
    )


def run_config(config: PPOConfig, model, reward_model, reward_functions) -> PPOConfig:
    """The run's own copy of `config`, validated: the caller's object is never changed. Objects passed in place of
    config entries are recorded as what can be recorded of them: the policy's saved path (if it has one) and the
    reward functions' labels."""
    config = copy.deepcopy(config)
    if model is not None and config.model is None:
        config.model = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    if reward_functions is not None:
        config.reward.functions = [source_label(f) for f in reward_functions]
    return config.validate(model_given=model is not None, reward_model_given=reward_model is not None)
