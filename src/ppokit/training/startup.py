"""What a PPO run refuses before any weights load, decided once, for `ppokit ppo` and `ppokit plan` alike.

    check_config  the config and the process count alone: run by both commands before anything is read or written
                  (the Python tool's sandbox, the batch arithmetic when ppo.total_episodes is set)
    prepare       what needs the prompts, the tokenizer and this machine, in the order the run meets it:
                  1. what the switches need of this machine (`machine.check_machine`: CUDA for quantization and fp16,
                     peft, a compiler, a tracker)
                  2. the prompts (data readable; eval prompts where ppo.eval_samples_per_prompt or eval_pass_at_k asks),
                     the tokenizer, the batch arithmetic with the prompts counted
                  3. the output folder (`run_dir.check_run_folder`: not `.`, not a file, not another tool's)
                  4. the conversation (chat template, environment, stop token), the prompts' token ids, the micro-batch
                     token budget against the longest row (`lengths.check_budget`)
                  5. a `teacher`'s vocabulary against the policy's tokenizer (`loading.check_teacher`)
                  6. the reward sources that load no weights (`rewards.check_sources`: functions found and their
                     signatures checked against the data's columns, the remote scorer, reward.weights' count), and
                     rollout.dynamic_sampling_metric among their names

The trainer's set-up (`parts.assemble`) builds the run on what `prepare` returns; `ppokit plan` runs the same two, loading
no weights and writing nothing, so a config the run refuses is refused by the plan with the same one line and exit
status 2. A refusal added to either function is therefore one for both commands. Torch is imported only by `prepare`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence


def check_config(config, processes: Optional[int] = None) -> None:
    """What a run refuses from the loaded config and the process count alone (`processes`, default WORLD_SIZE, else 1),
    before anything is written or loaded."""
    from ppokit.training import batch_sizes
    from ppokit.environments.python_tool import check_config as check_python_tool
    from ppokit.errors import UserError
    from ppokit.process.launcher import launched_processes

    if processes is not None and processes < 1:
        raise UserError(f"--processes {processes}: must be at least 1")
    check_python_tool(config.environment, config.environment_args, Path.cwd())  # the sandbox the Python tool needs
    if config.ppo.total_episodes is not None:  # without it the batch arithmetic needs the prompts (`prepare`)
        batch_sizes.derive(config.ppo, processes or launched_processes(), 0)


@dataclass
class Start:
    """What `prepare` read and checked: the run's set-up goes on from it."""

    train_data: Any  # prompts.PromptDataset
    eval_data: Any  # Optional[prompts.PromptDataset]
    tokenizer: Any
    sizes: Any  # batch_sizes.BatchSizes
    conversation: Any  # environments.conversation.Conversation
    train_query_ids: list[list[int]]
    eval_query_ids: Optional[list[list[int]]]
    rewards: Any  # rewards.CheckedSources


def prepare(config, *, processes: int, check_folder: bool = True, overwrite: bool = False,
            say: Callable[[str], None] = lambda message: None, model=None, tokenizer=None, reward_model_given: bool = False,
            reward_functions: Optional[Sequence] = None, train_dataset=None, eval_dataset=None) -> Start:
    """Every check of a validated `config` that needs no weights, in the run's order (the module's docstring); a
    UserError at the first refusal. processes: how many the run has; check_folder: check output_dir (its main process
    does, `overwrite`: as `--overwrite`); say: notices for the user. model / tokenizer / reward_functions /
    train_dataset / eval_dataset: objects passed to `PPOTrainer` in place of the config's entries; reward_model_given:
    a reward model object is passed. Writes nothing."""
    from ppokit.run import run_dir
    from ppokit.training import batch_sizes
    from ppokit.environments.conversation import conversation_for
    from ppokit.data.lengths import check_budget, encode_prompts
    from ppokit.process.machine import check_machine
    from ppokit.models.loading import check_teacher, policy_tokenizer
    from ppokit.data.prompts import load_prompt_data
    from ppokit.rewards import check_sources
    from ppokit.errors import UserError

    check_machine(lora=config.lora is not None, quantization=config.quantization, fp16=config.fp16, compile=config.compile,
                  strategy=config.parallel.strategy, report_to=config.report_to, matmul_backend=config.matmul_backend,
                  cpu_allocator=config.cpu_allocator)
    train_data, eval_data = load_prompt_data(config.data, config.seed, train_dataset, eval_dataset)
    samples = "ppo.eval_pass_at_k" if config.ppo.eval_pass_at_k else "ppo.eval_samples_per_prompt" if config.ppo.eval_samples_per_prompt > 1 else None
    if samples and eval_data is None:  # the sample generations would take the training batch, and never read it
        raise UserError(f"{samples} samples the eval prompts, and this run has none; set data.eval or data.eval_fraction (or pass eval_dataset=)")
    tokenizer = policy_tokenizer(tokenizer, model, tokenizer_name=config.tokenizer, model_name=config.model,
                                 trust_remote_code=config.trust_remote_code)
    sizes = batch_sizes.derive(config.ppo, processes, len(train_data))
    if check_folder:
        run_dir.check_run_folder(config.output_dir, overwrite)  # a folder it must not write in
    # the environment made, the chat template checked against it, chat prompts rendered with its tools
    conversation = conversation_for(config, tokenizer, [train_data, eval_data], say, base_dir=Path.cwd())
    train_query_ids, eval_query_ids = encode_prompts(tokenizer, {"data.train": train_data, "data.eval": eval_data},
                                                     config.data.max_prompt_length, say)
    check_budget(config.ppo.max_tokens_per_micro_batch, [len(q) for q in train_query_ids], config.response_room)
    if config.teacher is not None:
        check_teacher(config.teacher, tokenizer, config.trust_remote_code)
    metric = config.rollout.dynamic_sampling_metric  # `score`, or a reward source's name
    rewards = check_sources(
        config.reward, reward_functions=reward_functions, base_dir=Path.cwd(), reward_model=reward_model_given or bool(config.reward.model),
        data_columns={f"data.{split} ({data.source})": set(data.columns) for split, data in (("train", train_data), ("eval", eval_data)) if data},
        environment=config.episodes_answered, teacher=config.teacher is not None,
        names_a_source=(("rollout.dynamic_sampling_metric", metric) if config.rollout.dynamic_sampling and metric != "score" else None))
    if conversation.runner is not None and not conversation.runner.gives_rewards and config.teacher is None and not (
            rewards.functions or rewards.remote or reward_model_given or config.reward.model):
        raise UserError(f"environment {config.environment}: no class of it defines get_reward, and the reward: section names "
                        "no other source: every episode would score 0; add reward.functions or a get_reward method")
    return Start(train_data, eval_data, tokenizer, sizes, conversation, train_query_ids, eval_query_ids, rewards)

