"""PPOTrainer: one update is a sequence of numbered stages, readable top to bottom in `step`.

    1. generate   sample n responses for each prompt of the batch (the rollout engine, or episodes over an environment)
    2. score      reward sources on prompt + completion text (and token ids); the greedy baseline an estimator asks for
    3. forward    reference logprobs and (with a critic) values for every trained token
    4. reward     per-token KL penalty (ppo.kl_in_reward) plus the score at each episode's score position
    5. advantages ppo.advantage_estimator's function (ppokit.estimators: gae, grpo, rloo, reinforce_pp, remax)
    6. optimise   num_ppo_epochs passes of clipped policy (+ value) loss over minibatches (ppokit.optimise)
    7. log        metrics.jsonl, console, samples.jsonl
    8. save       checkpoint every save_steps, final model at the end

Stages 2-5 are functions of their explicit inputs in ppokit.experience; the trainer holds what they read
(models, scorer, settings) and hands it to them."""

from __future__ import annotations

import copy
import gc
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

from ppokit import algo, batching, checkpoint, engines, experience, launcher, model_card, parallel, random_states, roles, run_dir, trackers
from ppokit.checkpoint import RunFacts, TrainedParts
from ppokit.config import PPOConfig
from ppokit.engines.correction import use_trainer_logprobs
from ppokit.episodes import Episodes, repeat_each
from ppokit.environments.episode_loop import EnvironmentReward, conversation_setup, data_rows, episode_source, response_room, sample_row
from ppokit.errors import UserError
from ppokit.guards import (
    NonFiniteUpdate,
    StopSignals,
    TrainingInterrupted,
    UpdateSnapshot,
    check_finite,
    rollback_file,
    nothing_trained,
    too_many_skipped,
    check_some_scored,
)
from ppokit.metric_sinks import open_sinks
from ppokit.metric_values import eval_metrics, objective_metrics
from ppokit.models import (
    check_output_head, ensure_pad_token, input_pad_id, load_tokenizer, no_progress_bars, resolve_stop_token,
)
from ppokit.optimise import PolicyAndValue, build_optimiser, ppo_epochs
from ppokit.prompts import batch_indices, check_prompts_fit, encode_prompts, load_prompt_data
from ppokit.rewards import build_scorer, source_label
from ppokit.state import TrainingState


class PPOTrainer:
    """Train a causal LM with PPO against one or more reward sources.

    Args:
        config: a PPOConfig (paths in it are used for anything not passed as an object). The
            trainer works on its own copy (`trainer.config`); the caller's object is not changed.
        model: policy, a `PreTrainedModel` or a path/hub id; default `config.model`.
        tokenizer: the policy's tokenizer; default loaded from `config.tokenizer` or the model path.
        ref_model: frozen reference; default `config.ref_model`, else a frozen copy of the policy.
        value_model: one-label sequence classifier; default `config.value_model`, else the reward
            model's weights, else the policy's backbone with a fresh zero head (`roles.decide_roles`).
        reward_model: one-label sequence classifier (object or path); default `config.reward.model`.
        reward_tokenizer: the reward model's tokenizer when it is passed as an object.
        reward_functions: callables fn(prompts, completions, **columns) -> list[float], reward
            sources (objects with `name` and `score(ScoringBatch)`, e.g. `RemoteReward`), or entries
            as in `reward.functions`; they replace `config.reward.functions`.
        train_dataset / eval_dataset: a path, a list of prompts or row dicts, or a `datasets.Dataset`.
        overwrite: a fresh run may replace the run in output_dir (kept until this one's first
            checkpoint) or write into a folder that ppokit did not make (`ppokit.run_dir`).
    """

    def __init__(
        self,
        config: PPOConfig,
        *,
        model=None,
        tokenizer=None,
        ref_model=None,
        value_model=None,
        reward_model=None,
        reward_tokenizer=None,
        reward_functions: Optional[Sequence[Callable | str]] = None,
        train_dataset=None,
        eval_dataset=None,
        accelerator: Optional[Accelerator] = None,
        show_progress: bool = True,
        overwrite: bool = False,
    ):
        self.config = config = _run_config(config, model, reward_model, reward_functions)
        roles.check_environment(config)  # before any weights load
        trackers.check_usable(config.report_to)  # likewise: a missing tracker package or an unwritable store is one line, not a late crash
        self.accelerator = accelerator or _make_accelerator(config)
        self.strategy = parallel.strategy(config.parallel, self.accelerator, bf16=config.bf16)
        set_seed(config.seed)
        self.output_dir, self.overwrite, self.run = Path(config.output_dir), overwrite, None
        if self.accelerator.is_main_process:
            run_dir.check_run_folder(config.output_dir, overwrite)  # a folder it must not write in fails before any loading
        self.show_progress = show_progress and self.accelerator.is_main_process
        # Data first: a bad file should fail before any weights are loaded.
        self.train_data, self.eval_data = load_prompt_data(config.data, config.seed, train_dataset, eval_dataset)
        self.sizes = config.ppo.derive(self.accelerator.num_processes, len(self.train_data))
        self.tokenizer = self._tokenizer(tokenizer, model)
        self.stop_token_id = resolve_stop_token(self.tokenizer, config.ppo.stop_token, config.ppo.stop_token_id)
        self.conversation = self._conversation()  # the environment, the template checked, chat prompts rendered with its tools
        limit = config.data.max_prompt_length
        self.train_query_ids = encode_prompts(self.tokenizer, self.train_data, limit, "data.train", self._say)
        self.eval_query_ids = encode_prompts(self.tokenizer, self.eval_data, limit, "data.eval", self._say) if self.eval_data else None
        room = response_room(config.rollout, config.environment, config.ppo.response_length)  # tokens after the prompt
        batching.check_budget(config.ppo.max_tokens_per_micro_batch, [len(q) for q in self.train_query_ids], room)
        self.scorer = self._scorer(reward_model, reward_tokenizer, reward_functions)
        reward_vocabulary = None if self.scorer.reward_model is None else self.scorer.reward_model_shares_vocabulary(self.tokenizer)
        self.layout = roles.decide_roles(
            config, reward_vocabulary=reward_vocabulary, ref_model_given=ref_model is not None, value_model_given=value_model is not None
        )
        given = dict(model=model, ref_model=ref_model, value_model=value_model)
        readers = roles.configs_reading_policy_ids(self.layout, config, self.scorer, reward_vocabulary, **given)
        self.pad_id = input_pad_id(self.tokenizer, readers.values())  # what pads every model input (not text)
        check_prompts_fit(readers, [("data.train", self.train_data, self.train_query_ids), ("data.eval", self.eval_data, self.eval_query_ids)],
                          room, limit, self.tokenizer, self.stop_token_id)
        built = roles.build_roles(self.layout, config, self.scorer, **given)
        self.model, self.optimizer, self.scheduler, self.ref_model = self._prepare(built)
        self.rollout_engine = engines.build(config.rollout.engine, engines.EngineSetup(
            lambda: self.policy, self.pad_id, self.accelerator.device, config.ppo.local_rollout_forward_batch_size,
            lambda policy: (self.strategy.generation(policy), self.accelerator.autocast()), config.rollout,
            longest_sequence=max(map(len, self.train_query_ids + (self.eval_query_ids or []))) + room,
            rows_per_rollout=self.sizes.local_batch, seed=config.seed))
        self.episode_source = episode_source(  # decided once: the engine's own generate, or multi-turn episodes over it
            self.rollout_engine, self.conversation, rollout=config.rollout, response_length=config.ppo.response_length,
            pad_token_id=self.pad_id, reward=config.reward)
        self.kl_controller = algo.kl_controller(config.ppo.kl_coef, config.ppo.kl_target, config.ppo.kl_horizon)
        self.state = TrainingState()
        self._saved_at: Optional[tuple[int, Path]] = None  # (update, path) of the last checkpoint written or resumed from
        self._last_batch: tuple[list, list, list, list] = ([], [], [], [])  # prompts, completions, scores, turns of the last update

    # ------------------------------------------------------------------ set-up steps

    def _say(self, message: str) -> None:
        """A notice for the user: stderr, main process only (stdout carries results alone)."""
        if self.show_progress:
            print(f"ppokit: {message}", file=sys.stderr)

    def _tokenizer(self, tokenizer, model):
        """The tokenizer passed in or loaded."""
        config = self.config
        if tokenizer is not None:
            return ensure_pad_token(tokenizer)
        where = "tokenizer" if config.tokenizer else "model"
        return load_tokenizer(config.tokenizer or _path_of(model, config.model), config.trust_remote_code, where)

    def _conversation(self):
        """The run's conversation (`episode_loop.conversation_setup`): the environment made, the chat template checked
        against it, chat prompts rendered with its tools; the template used is recorded in the run's config."""
        config = self.config
        conversation = conversation_setup(
            self.tokenizer, chat_template=config.data.chat_template, template_kwargs=config.data.chat_template_kwargs,
            datasets=[self.train_data, self.eval_data], environment=config.environment, environment_args=config.environment_args,
            timeout_s=config.environment_timeout_s, max_turns=config.rollout.max_turns, stop_token_id=self.stop_token_id,
            base_dir=Path.cwd(), say=self._say)
        if conversation.template is not None:
            config.data.chat_template = conversation.template
        return conversation

    def _scorer(self, reward_model, reward_tokenizer, reward_functions):
        config = self.config
        data_columns = {f"data.train ({self.train_data.source})": set(self.train_data.columns)}
        if self.eval_data is not None:
            data_columns[f"data.eval ({self.eval_data.source})"] = set(self.eval_data.columns)
        return build_scorer(
            config.reward, missing_eos_penalty=config.ppo.missing_eos_penalty, reward_model=reward_model,
            reward_tokenizer=reward_tokenizer, reward_functions=reward_functions, trust_remote_code=config.trust_remote_code,
            base_dir=Path.cwd(), all_reduce=self._sum_over_processes if self.accelerator.num_processes > 1 else None,
            load_kwargs=roles.load_kwargs(config), data_columns=data_columns, verdict=parallel.stop_together(self.accelerator),
            environment=EnvironmentReward() if config.environment is not None else None,
            reward_model_by_tokens=config.ppo.max_tokens_per_micro_batch is not None,
        )

    def _prepare(self, built: roles.Roles):
        """Policy and critic under one trainable module with its optimiser over every optimiser step of the
        run; frozen models placed by the strategy too. -> (model, optimizer, scheduler, reference or None)."""
        config, hp = self.config, self.config.ppo
        steps = self.sizes.num_updates * hp.num_ppo_epochs * hp.num_mini_batches
        switch = "lm_head_chunk_size" if config.lm_head_chunk_size else "compile" if config.compile else None
        for role in (built.policy, built.reference) if switch else ():
            if role is not None:  # the light head and the compiled forward read logits from the last hidden state
                check_output_head(role, switch)
        model, optimizer, scheduler = self.strategy.prepare(PolicyAndValue(built.policy, built.value, config.lm_head_chunk_size).train(),
                                                          lambda m: build_optimiser(m, hp, steps))
        if config.compile:
            self.accelerator.unwrap_model(model).use_compiled_backbones()
        if self.scorer.reward_model is not None:
            self.strategy.place_frozen(self.scorer.reward_model).eval()
        reference = self.strategy.place_frozen(built.reference).eval() if built.reference is not None else None
        return model, optimizer, scheduler, reference

    def _run_folder(self) -> run_dir.RunFolder:
        """output_dir, locked for this run (until train() ends), its leftovers cleared (`ppokit.run_dir`)."""
        if self.run is None:
            self.run = run_dir.RunFolder.open(self.output_dir, self.accelerator.is_main_process, self.overwrite)
            weakref.finalize(self, self.run.close)
            for note in self.run.notes:
                self._say(note)
        return self.run

    def _sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.accelerator.num_processes == 1:
            return tensor
        return self.accelerator.reduce(tensor.to(self.accelerator.device), reduction="sum").to(tensor.device)

    # ------------------------------------------------------------------ data order

    def batch_indices(self, update: int) -> list[int]:
        """Prompt indices of update `update` (0-based) on this process (`prompts.batch_indices`)."""
        return batch_indices(update, len(self.train_data), self.sizes.prompts_per_update, self.config.seed,
                             self.accelerator.process_index, self.accelerator.num_processes)

    # ------------------------------------------------------------------ one update

    @property
    def policy(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model).policy

    @property
    def value_model(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model).value_model

    def generate(self, query_ids: list[list[int]], prompts: list[str], columns: dict, purpose: str = "train"):
        """-> (episodes, what their environment said or None): one response per query by the rollout engine, or with an
        `environment` a multi-turn episode over it (environments.episode_loop), the data rows (`prompts`, `columns`)
        given to its reset; purpose: train, eval or greedy (engines.Sampling.for_purpose)."""
        sampling = engines.Sampling.for_purpose(self.config.ppo, self.stop_token_id, purpose)
        return self.episode_source.sample(query_ids, data_rows(prompts, columns), sampling)

    def score(self, episodes: Episodes, outcome, prompts: list[str], columns: dict, update_statistics: bool = True) -> tuple[torch.Tensor, dict]:
        """-> (scores (B,), {completions, turns, valid, errors, metrics}) by this run's reward sources (`experience.score`)."""
        return experience.score(self.scorer, self.tokenizer, episodes, outcome, prompts, columns, stop_token_id=self.stop_token_id,
                                device=self.accelerator.device, update_statistics=update_statistics, all_reduce=self._sum_over_processes)

    def optimise(self, episodes: Episodes) -> dict[str, float]:
        """num_ppo_epochs passes over shuffled minibatches (ppokit.optimise); returns the loss statistics.
        During the first ppo.critic_warmup_updates updates only the critic moves. The rollout engine gives its
        memory to the training meanwhile, and samples from the updated weights after it."""
        hp = self.config.ppo
        with engines.training_between_rollouts(self.rollout_engine, self.policy):
            return ppo_epochs(self.model, self.optimizer, self.scheduler, episodes, hp, self.sizes, self.strategy,
                              self._sum_over_processes, train_policy=self.state.update >= hp.critic_warmup_updates,
                              on_skipped_step=self._say_skipped_step)

    def _say_skipped_step(self, bad: NonFiniteUpdate) -> None:
        if self.show_progress:
            print(f"update {self.state.update + 1}: an optimiser step skipped, {bad}", file=sys.stderr)

    def greedy_baseline(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The baseline of an estimator with `greedy_baseline` (ReMax): the score of one greedy response to each
        training prompt `indices`, repeated for its n samples -> (scores (B,), valid (B,) bool). Scored without
        moving the reward normalisation."""
        n = self.sizes.samples_per_prompt
        _, scores, extras = self._sample_and_score(self.train_data, self.train_query_ids, indices, "greedy")
        return scores.repeat_interleave(n), extras["valid"].repeat_interleave(n)

    def _sample_and_score(self, data, query_ids: list[list[int]], rows, purpose: str) -> tuple[Episodes, torch.Tensor, dict]:
        """Episodes for prompts `rows` of `data` sampled for `purpose`, and their scores and extras (`score`), scored
        without moving the reward normalisation."""
        prompts, columns = data.rows(rows)
        episodes, outcome = self.generate([query_ids[i] for i in rows], prompts, columns, purpose=purpose)
        return episodes, *self.score(episodes, outcome, prompts, columns, update_statistics=False)

    def step(self) -> dict[str, Any]:
        """Run one PPO update and return its metrics."""
        state, hp = self.state, self.config.ppo
        estimator = hp.estimator
        if state.update >= self.sizes.num_updates:
            raise UserError(
                f"all {self.sizes.num_updates} updates of ppo.total_episodes={self.sizes.total_episodes} are done; "
                "raise ppo.total_episodes to train further"
            )
        t0 = time.perf_counter()
        n = self.sizes.samples_per_prompt
        indices = self.batch_indices(state.update)
        samples = repeat_each(indices, n)  # n samples of each prompt, in adjacent rows (the episodes' group layout)
        prompts, columns = self.train_data.rows(samples)

        # 1. generate
        episodes, outcome = self.generate([self.train_query_ids[i] for i in samples], prompts, columns)
        t_generate = time.perf_counter()

        # 2. score
        episodes.scores, extras = self.score(episodes, outcome, prompts, columns)
        if estimator.greedy_baseline:
            episodes.baseline_scores, baseline_valid = self.greedy_baseline(indices)
            extras["valid"] = extras["valid"] & baseline_valid
        episodes.valid = extras["valid"]  # failed rows (on_error: skip) leave the update
        check_finite({"score": episodes.scores}, self.accelerator)
        check_some_scored(extras["valid"], extras["errors"], self.accelerator)
        t_score = time.perf_counter()

        # 3. forward: reference logprobs and values (and the policy's own logprobs, where the engine's are not the trainer's)
        episodes.ref_logprobs, episodes.values, trainer_logprobs = experience.reference_and_values(
            episodes, self.accelerator.unwrap_model(self.model), self.ref_model, rows=hp.local_rollout_forward_batch_size,
            packed=hp.max_tokens_per_micro_batch is not None, temperature=hp.temperature, chunk_size=self.config.lm_head_chunk_size,
            autocast=self.accelerator.autocast, policy_logprobs=not self.rollout_engine.logprobs_are_trainers)
        mismatch = use_trainer_logprobs(episodes, trainer_logprobs, hp.rollout_is, hp.rollout_is_cap, self._sum_over_processes,
                                        floor=hp.rollout_is_floor)
        t_forward = time.perf_counter()

        # 4. reward: per-token KL penalty (when it is in the reward), the score at each episode's score position
        kl_coef = self.kl_controller.value if hp.kl_in_reward else 0.0
        episodes.rewards, kl, non_score = experience.rewards(
            episodes, outcome, kl_estimator=hp.kl_estimator, kl_clamp=hp.kl_clamp, kl_coef=kl_coef, whiten=hp.whiten_rewards,
            place_rewards=self.episode_source.place_rewards)  # rollout.turn_rewards

        # 5. advantages
        episodes.advantages, episodes.returns = experience.advantages(
            estimator, episodes, gamma=hp.gamma, lam=hp.lam, whiten=hp.whiten_advantages, group_size=n,
            grpo_scale_std=hp.grpo_scale_std, all_reduce=self._sum_over_processes)

        # 6. optimise
        lrs = self.scheduler.get_last_lr()
        train_stats = self.optimise(experience.trained_on(episodes, mask_truncated_completions=hp.mask_truncated_completions))
        t_train = time.perf_counter()

        # 7. log
        state.update += 1
        state.episode += self.sizes.batch
        objective = objective_metrics(episodes, kl, non_score, extras["valid"], kl_coef, self._sum_over_processes)
        self.kl_controller.update(objective["objective/kl"], self.sizes.batch)
        elapsed = t_train - t0
        record = {
            "update": state.update,
            "episode": state.episode,
            **objective,
            **mismatch,
            **train_stats,
            **extras["metrics"],
            "lr": lrs[0],
            **({"lr/value": lrs[1]} if hp.vf_learning_rate is not None or hp.critic_warmup_updates else {}),
            "eps": self.sizes.batch / elapsed,
            "time/generation": t_generate - t0,
            "time/scoring": t_score - t_generate,
            "time/forward": t_forward - t_score,
            "time/training": t_train - t_forward,
            "time/update": elapsed,
        }
        self._last_batch = (prompts, extras["completions"], _scores_or_none(episodes.scores, extras["valid"]), extras["turns"])
        return record

    # ------------------------------------------------------------------ the run

    def train(self) -> list[dict]:
        """Run every update; write the run directory. Returns the list of metric records."""
        try:
            self._train()
        except (OSError, RuntimeError) as e:  # a full disk; another process gone
            last = self._saved_at and self._saved_at[1]
            said = (run_dir.full_disk(e, self._run_facts().output_dir, last) or parallel.lost_process(e, self.accelerator, last)
                    or engines.base.engine_lost(e, last))
            if said is None:
                raise
            raise said from None
        finally:
            self.rollout_engine.close()
            if self.run is not None:
                self.run.close()  # the lock; a replacing run that reached no checkpoint leaves the earlier one as it was
                self.run = None
        return self.state.records

    def _train(self) -> None:
        hp, state, is_main = self.config.ppo, self.state, self.accelerator.is_main_process
        files = self._run_folder().start(fresh=state.update == 0, overwrite=self.overwrite, barrier=self.accelerator.wait_for_everyone)
        parallel.check_shared_folder(files, self.accelerator)
        if is_main:
            self.config.save(files / "config.yaml")
        # A resumed run's files were rewritten to the checkpoint's by resume_from; they continue from there.
        sinks = open_sinks(self.config, total_updates=self.sizes.num_updates, done_updates=state.update, is_main=is_main,
                           show_progress=self.show_progress, folder=files)
        sample_every = max(1, self.sizes.num_updates // hp.num_sample_generations) if hp.num_sample_generations else 0
        signals = StopSignals(lambda: self._saved_at[1] if self._saved_at else None, lambda: state.update, self.accelerator).install()
        # Set-up allocated many long-lived objects; freezing them keeps each gc pass short.
        gc.collect()
        gc.freeze()
        try:
            while state.update < self.sizes.num_updates:
                record = self._saved_if_it_fails(self.run_update)
                last = state.update == self.sizes.num_updates
                if sample_every and not state.skipped_in_a_row and (state.update % sample_every == 0 or last):
                    rows = self._saved_if_it_fails(self.sample_completions, record)
                    scored = [r["score"] for r in rows if r["score"] is not None]
                    if scored and self.eval_data is not None:  # without eval data the rows are the training batch's
                        record["eval/scores"] = sum(scored) / len(scored)
                    sinks.samples(rows)
                state.records.append(record)
                sinks.record(record)
                if hp.save_steps and state.update % hp.save_steps == 0 and not last:
                    self.save_checkpoint()
                self._stop_if_asked(signals)
        finally:
            signals.uninstall()
            sinks.close()
            gc.unfreeze()
        path = self.save_checkpoint()
        if state.skipped_updates == state.update:
            raise nothing_trained(state, path)  # final/ would look finished with the starting weights
        self.save_final()

    def _saved_if_it_fails(self, part: Callable, finished_record: Optional[dict] = None):
        """part(), or on a user error (a reward source failing under reward.on_error=raise) a checkpoint of
        the last complete update first, so that no update done so far is lost; then the error, with it.
        `finished_record`: the update whose samples failed is itself complete (its record is kept)."""
        try:
            return part()
        except UserError as error:
            if self.accelerator.num_processes > 1 and not isinstance(error, parallel.EveryProcessStops):
                raise  # the other processes are not stopping with it: no collective save can be made
            if finished_record is not None:
                self.state.records.append(finished_record)
            if not self.state.update:
                raise
            raise UserError(f"{error}. Updates 1-{self.state.update} are saved in {self.save_checkpoint()}; "
                            "fix the cause and continue with --resume") from None

    def run_update(self) -> dict[str, Any]:
        """`step` under the non-finite guard. An update whose score is NaN or infinite, whose every optimiser
        step had a non-finite loss or gradient, or (ppo.nonfinite_rollback memory/disk) any step did, is
        rolled back to its start (ppokit.guards.UpdateSnapshot), counted in `skipped_updates` and logged
        as `nonfinite/<quantity>`; its batch is not retried (the data position moves on)."""
        hp, state = self.config.ppo, self.state
        t0 = time.perf_counter()
        file = rollback_file(self.run.files if self.run is not None else self.output_dir, self.accelerator.process_index)
        snapshot = UpdateSnapshot(self.model, self.optimizer, self.scheduler, hp.rollback, file)
        rng = random_states.rng_state()
        try:
            record = self.step()
        except UserError:
            # Scoring fails before any optimiser step: the state is the last complete update's, but for the
            # random draws already made; they are undone too, so that a checkpoint now is that update's.
            snapshot.restore(scheduler_steps=0)
            random_states.set_rng_state(rng)
            raise
        except NonFiniteUpdate as bad:
            snapshot.restore(scheduler_steps=hp.num_ppo_epochs * hp.num_mini_batches)
            self.model.train()
            state.count_skipped(str(bad), self.sizes.batch)
            if self.show_progress:
                print(f"update {state.update}: skipped{' and rolled back' if hp.rollback != 'off' else ''}, {bad}", file=sys.stderr)
            return {
                "update": state.update, "episode": state.episode, f"nonfinite/{bad.quantity}": 1,
                "skipped_updates": state.skipped_updates, "time/update": time.perf_counter() - t0,
            }
        finally:
            snapshot.discard()
        state.skipped_in_a_row = 0
        record["skipped_updates"] = state.skipped_updates
        return record

    def _stop_if_asked(self, signals: StopSignals) -> None:
        """After an update: stop with a checkpoint after too many non-finite updates or on SIGINT/SIGTERM."""
        hp, state = self.config.ppo, self.state
        if state.skipped_in_a_row >= hp.max_skipped_updates:
            raise too_many_skipped(state, hp, self.save_checkpoint())
        signum = signals.requested()
        if signum and state.update < self.sizes.num_updates:
            raise TrainingInterrupted(signum, state.update, self.save_checkpoint())

    def resume_from(self, path: str | Path | None = None, force: bool = False) -> Path:
        """Continue from checkpoint `path` (default: the latest complete one in output_dir/checkpoints);
        call train() next. Restores weights, optimiser, schedule, KL controller, reward-source state,
        RNG states, counters and metrics. A config that would change the result is refused unless `force`."""
        path = checkpoint.find_checkpoint(str(path) if path is not None else None, self.output_dir, self._say)
        run_dir.check_resume_into(self.output_dir, path)
        self._run_folder()  # this run's from here on: the lock before anything is restored into it
        self.state = checkpoint.load_checkpoint(path, self._trained_parts(), self.config, self._run_facts(), self.accelerator,
                                                force=force, say=self._say)
        self.sizes = self.sizes._replace(num_updates=checkpoint.continued_updates(self.sizes.total_episodes, self.sizes.batch, self.state, path))
        own = checkpoint.checkpoints_dir(self.output_dir) / f"update-{self.state.update}"
        # The checkpoint to name after a stop; it is re-saved only when it is another folder's.
        self._saved_at = (self.state.update if own.exists() and own.resolve() == path.resolve() else -1, path)
        self.rollout_engine.sync_weights(self.policy)
        return path

    def _trained_parts(self) -> TrainedParts:
        return TrainedParts(self.accelerator.unwrap_model(self.model), self.optimizer, self.scheduler, self.kl_controller, self.scorer,
                            self.layout.policy_adapter or self.layout.critic_adapter, self.strategy.checkpoint_weights())

    def _run_facts(self) -> RunFacts:
        files = self.run.files if self.run is not None else self.output_dir  # where this run writes now (`RunFolder.start`)
        return RunFacts(files, self.train_data, self.eval_data, self.sizes.batch, self.sizes.num_updates,
                        self.config.ppo.save_total_limit, self.sizes.samples_per_prompt)

    @torch.inference_mode()
    def evaluate(self, max_prompts: Optional[int] = None, seed: Optional[int] = None) -> dict[str, float]:
        """Sample completions for the eval prompts (all of them, or the first `max_prompts`) with the
        current policy, score them, and return `eval/scores`, `eval/response_length`, `eval/ended`
        (share of responses that produced the stop token) and `eval/num_scored`.

        Sampling is at `ppo.eval_temperature` (default the training temperature; 0: greedy) with its
        own generator seeded with `seed` (default `config.seed`), so the result is repeatable and
        training's random stream is left as it was. Reward normalisation statistics are not updated.
        """
        if self.eval_data is None:
            raise UserError("evaluate: no eval prompts; set data.eval or data.eval_fraction, or pass eval_dataset=")
        n = len(self.eval_data) if max_prompts is None else min(max_prompts, len(self.eval_data))
        chunk = self.config.ppo.local_rollout_forward_batch_size
        scores, lengths, ended = [], [], []
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.config.seed if seed is None else seed)
            for start in range(0, n, chunk):
                episodes, batch_scores, extras = self._sample_and_score(self.eval_data, self.eval_query_ids,
                                                                        range(start, min(n, start + chunk)), "eval")
                valid = extras["valid"]
                scores += batch_scores[valid].tolist()
                lengths += episodes.loss_mask.sum(1)[valid].tolist()
                ended += episodes.ended[valid].tolist()
        if not scores:
            raise UserError(f"evaluate: no reward source could score any of the {n} eval completions")
        return eval_metrics(scores, lengths, ended)

    @torch.inference_mode()
    def sample_completions(self) -> list[dict]:
        """Completions for a few eval prompts (or the current batch), scored, as samples.jsonl rows
        (score None for a row no reward source could score under reward.on_error=skip)."""
        hp = self.config.ppo
        if self.eval_data is not None:
            n = min(hp.num_eval_samples, len(self.eval_data))
            prompts = self.eval_data.prompts[:n]
            _, scores, extras = self._sample_and_score(self.eval_data, self.eval_query_ids, range(n), "eval")
            completions, scores, turns, split = extras["completions"], _scores_or_none(scores, extras["valid"]), extras["turns"], "eval"
        else:
            prompts, completions, scores, turns = (x[: hp.num_eval_samples] for x in self._last_batch)
            split = "train"
        return [
            sample_row({"update": self.state.update, "episode": self.state.episode, "split": split, "prompt": p, "completion": c, "score": s}, t)
            for p, c, s, t in zip(prompts, completions, scores, turns)
        ]

    def save_checkpoint(self) -> Path:
        """The whole training state in output_dir/checkpoints/update-N/ (see ppokit.checkpoint), once per update."""
        update = self.state.update
        if self._saved_at is None or self._saved_at[0] != update:
            path = checkpoint.save_checkpoint(self.state, self._trained_parts(), self.config, self._run_facts(),
                                              lambda folder: self.save_models(folder, merged=False, kind="model"), self.accelerator)
            run, replacing = self._run_folder(), self._run_folder().staged
            self._saved_at = (update, run.commit(path))  # a run replacing another takes its place now
            if replacing:
                self._say(f"{run.root}: the earlier run there is replaced by this one, whose first checkpoint is written")
        return self._saved_at[1]

    def save_final(self) -> Path:
        """policy + tokenizer + model card in final/, the value model (with the tokenizer, if there is one) in final/value_model/, whole."""
        target = self._run_folder().commit() / "final"
        card = model_card.ppo_card(self.config, self.state.records[-1] if self.state.records else None, self.sizes.num_updates)
        try:
            self.save_models(target, replace_unmarked=self.overwrite, card=card)
        except run_dir.NoSpaceError as e:
            raise run_dir.full_disk(e, target, self._saved_at[1]) from None
        self.accelerator.wait_for_everyone()
        return target

    def save_models(self, target: Path, merged: bool = True, kind: str = "final", replace_unmarked: bool = False,
                    card: Optional[model_card.ModelCard] = None) -> None:
        """Policy, tokenizer and value model as loadable folders (with `card`, their README.md); `merged`: also
        final/merged/ if configured. Every process calls this; the main one writes the strategy's whole copy of the models."""
        with self.strategy.consolidated(self.model) as whole, no_progress_bars():
            if whole is not None:
                merged = merged and self.config.save_merged
                run_dir.atomic_save_dir(target, lambda folder: roles.write_models(folder, whole, self.tokenizer, merged, card), kind,
                                        replace_unmarked)


def _run_config(config: PPOConfig, model, reward_model, reward_functions) -> PPOConfig:
    """The run's own copy of `config`, validated: the caller's object is never changed. Objects
    passed in place of config entries are recorded as what can be recorded of them: the policy's
    saved path (if it has one) and the reward functions' labels."""
    config = copy.deepcopy(config)
    if model is not None and config.model is None:
        config.model = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    if reward_functions is not None:
        config.reward.functions = [source_label(f) for f in reward_functions]
    return config.validate(model_given=model is not None, reward_model_given=reward_model is not None)


def _make_accelerator(config: PPOConfig) -> Accelerator:
    launcher.check_launch()  # a malformed launcher environment is one line, not accelerate's traceback
    launcher.follow_launcher()  # before the rendezvous, which waits for a launcher that may be gone
    accelerator = Accelerator(mixed_precision=parallel.accelerator_mixed_precision(config.parallel, roles.mixed_precision(config)))
    launcher.check_world_size(accelerator.num_processes)
    return accelerator


def _scores_or_none(scores: torch.Tensor, valid: torch.Tensor) -> list[Optional[float]]:
    return [score if ok else None for score, ok in zip(scores.tolist(), valid.tolist())]


def _path_of(obj, fallback):
    if obj is not None and not isinstance(obj, str):
        path = getattr(getattr(obj, "config", None), "_name_or_path", None)
        if path and os.path.exists(path):
            return path
        raise UserError("pass `tokenizer=` (or `reward_tokenizer=`) when giving a model object without a saved path")
    return obj if obj is not None else fallback
