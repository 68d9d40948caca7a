"""PPOTrainer: a PPO run's life. One update is a sequence of numbered stages, readable top to bottom in `step`.

    1. generate   sample n responses for each prompt of the batch (the rollout engine, or episodes over an environment)
    2. score      reward sources on prompt + completion text (and token ids); the greedy baseline an estimator asks for
    3. forward    reference logprobs, (with a critic) values and (with a teacher) the teacher's logprobs for every trained token
    4. reward     per-token KL penalty (ppo.kl_in_reward), a teacher's reverse KL, plus the score at each score position
    5. advantages ppo.advantage_estimator's function (ppokit.training.estimators: gae, grpo, rloo, reinforce_pp, remax)
    6. optimise   num_ppo_epochs passes of clipped policy (+ value) loss over minibatches (ppokit.training.optimise)
    7. log        metrics.jsonl, console, samples.jsonl
    8. save       checkpoint every save_steps, final model at the end

The trainer holds the run's parts (`ppokit.training.parts`, built once from the config), its state (`ppokit.run.state`) and its
saving (`ppokit.training.saving`); stages 1-2 are `ppokit.training.rollout`'s, 2-5 functions of their explicit inputs in
`ppokit.training.experience`, evaluation is `ppokit.training.evaluation`'s. None of them reads the trainer. Here: the order of the
stages, the run loop with its stop signals and sinks, and what a failure does to the run."""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from accelerate import Accelerator

from ppokit import engines

from ppokit.process import parallel, random_states

from ppokit.run import run_dir

from ppokit.training import dynamic_sampling, evaluation, experience, sampler
from ppokit.config.schema import PPOConfig
from ppokit.engines.correction import use_trainer_logprobs
from ppokit.training.episodes import Episodes
from ppokit.errors import UserError
from ppokit.training.guards import (StopSignals, TrainingInterrupted, UpdateSnapshot, check_finite, check_some_scored, guarded_update,
                           nothing_trained, rollback_file, saved_if_it_fails, too_many_skipped)
from ppokit.metrics.sinks import open_sinks
from ppokit.metrics.values import objective_metrics
from ppokit.training.optimise import ppo_epochs
from ppokit.training.parts import Parts, assemble
from ppokit.training.saving import Saving
from ppokit.run.state import TrainingState


class PPOTrainer:
    """Train a causal LM with PPO against one or more reward sources.

    Args:
        config: a PPOConfig (paths in it are used for anything not passed as an object); the trainer works on its own copy
            (`trainer.config`), the caller's object is not changed.
        model / tokenizer / ref_model: the policy (a `PreTrainedModel` or a path/hub id; default `config.model`), its tokenizer
            (default `config.tokenizer` or the model path's), the frozen reference (default `config.ref_model`, else a frozen copy).
        value_model: one-label sequence classifier; default `config.value_model`, else the reward model's weights, else the
            policy's backbone with a fresh zero head (`roles.decide_roles`).
        reward_model / reward_tokenizer: one-label sequence classifier (object or path; default `config.reward.model`), and its
            tokenizer when it is passed as an object.
        reward_functions: callables fn(prompts, completions, **columns) -> list[float], reward sources (objects with `name` and
            `score(ScoringBatch)`, e.g. `RemoteReward`), or entries as in `reward.functions`; they replace `config.reward.functions`.
        train_dataset / eval_dataset: a path, a list of prompts or row dicts, or a `datasets.Dataset`.
        overwrite: a fresh run may replace the run in output_dir (kept until this one's first checkpoint) or write into a folder
            that ppokit did not make (`ppokit.run.run_dir`).

    The run's parts are the trainer's attributes under their own names (`trainer.policy`, `trainer.tokenizer`, `trainer.model`,
    `trainer.optimizer`, `trainer.sizes`, ...: `ppokit.training.parts.Parts`).
    """

    def __init__(self, config: PPOConfig, *, model=None, tokenizer=None, ref_model=None, value_model=None, reward_model=None,
                 reward_tokenizer=None, reward_functions: Optional[Sequence[Callable | str]] = None, train_dataset=None,
                 eval_dataset=None, accelerator: Optional[Accelerator] = None, show_progress: bool = True, overwrite: bool = False):
        self.saving = Saving(config.output_dir, overwrite)  # the run folder's bookkeeping: nothing is read or written yet
        self.parts: Parts = assemble(
            config, model=model, tokenizer=tokenizer, ref_model=ref_model, value_model=value_model, reward_model=reward_model,
            reward_tokenizer=reward_tokenizer, reward_functions=reward_functions, train_dataset=train_dataset,
            eval_dataset=eval_dataset, accelerator=accelerator, show_progress=show_progress, overwrite=overwrite)
        self.state = TrainingState()
        run = self.config  # the run's validated copy (`parts.run_config`), not the caller's object
        prompts = sampler.UpdatePrompts(self.train_data, self.train_query_ids, self.sizes.prompts_per_update, self.sizes.samples_per_prompt,
                                        run.seed, self.accelerator.process_index, self.accelerator.num_processes)
        self.sampler = sampler.build(self.rollout, prompts, max_staleness=run.rollout.max_staleness, save_steps=run.ppo.save_steps, seed=run.seed)
        self.batches = dynamic_sampling.UpdateBatches(self.sampler, self.rollout, prompts, dynamic_sampling.Rule.of(run.rollout),
                                                      reduce=self.reduce, say=self.say)
        self._last_batch: list[dict] = []  # the last update's episodes as samples.jsonl rows (`evaluation.scored_rows`)
        self._samples_before: Optional[list[dict]] = None  # the eval samples of update 0, once drawn (`samples_before_training`)

    def __getattr__(self, name: str):
        parts = self.__dict__.get("parts")
        if parts is None or name.startswith("_") or not hasattr(parts, name):
            raise AttributeError(f"'PPOTrainer' object has no attribute {name!r}")
        return getattr(parts, name)

    def batch_indices(self, update: int) -> list[int]:
        """Prompt indices of update `update` (0-based) on this process (`prompts.batch_indices`); with rollout.dynamic_sampling, of round `update`."""
        return self.sampler.prompts.indices(update)

    # ------------------------------------------------------------------ one update

    def step(self) -> dict[str, Any]:
        """Run one PPO update and return its metrics."""
        parts, state, hp = self.parts, self.state, self.config.ppo
        if state.update >= parts.sizes.num_updates:
            raise UserError(f"all {parts.sizes.num_updates} updates of ppo.total_episodes={parts.sizes.total_episodes} are done; "
                            "raise ppo.total_episodes to train further")
        t0, rollout, reduce, n = time.perf_counter(), parts.rollout, parts.reduce, parts.sizes.samples_per_prompt

        # 1. generate (now, or taken from what was sampled ahead: rollout.max_staleness, ppokit.training.sampler) and 2. score; with
        # rollout.dynamic_sampling, rounds of prompts until the batch holds groups with spread (ppokit.training.dynamic_sampling)
        batch = self.batches.take(state, parts.sizes.num_updates)
        episodes, scored, indices, prompts, columns, ahead = batch.episodes, batch.scored, batch.indices, batch.prompts, batch.columns, batch.metrics
        t_generate = time.perf_counter() - batch.scoring_s  # the rounds' scoring counts in time/scoring
        episodes = experience.with_scores(episodes, scored, parts.pad_id, reduce, parts.strategy.uneven_forwards)  # + segment rows
        if hp.estimator.greedy_baseline:
            episodes.baseline_scores, valid = map(episodes.per_row, rollout.greedy_baseline(parts.train_data, parts.train_query_ids, indices, n, state.update))
            episodes.valid = episodes.valid & valid
        check_finite({"score": episodes.scores}, parts.accelerator)
        check_some_scored(episodes.valid, scored.errors, parts.accelerator)
        t_score = time.perf_counter()

        # 3. forward: reference logprobs and values (and the policy's own logprobs, where the engine's are not the trainer's)
        episodes.ref_logprobs, episodes.values, trainer_logprobs, episodes.teacher_logprobs = experience.reference_and_values(
            episodes, parts.accelerator.unwrap_model(parts.model), parts.ref_model, teacher=parts.teacher, rows=hp.local_rollout_forward_batch_size,
            packed=hp.max_tokens_per_micro_batch is not None, temperature=hp.temperature, chunk_size=self.config.lm_head_chunk_size,
            autocast=parts.accelerator.autocast, policy_logprobs=not rollout.engine.logprobs_are_trainers)
        mismatch = use_trainer_logprobs(episodes, trainer_logprobs, hp.rollout_is, hp.rollout_is_cap, reduce, floor=hp.rollout_is_floor)
        t_forward = time.perf_counter()

        # 4. reward: per-token KL penalty (when it is in the reward), the score at each episode's score position
        kl_coef = parts.kl_controller.value if hp.kl_in_reward else 0.0
        episodes.rewards, kl, non_score = experience.rewards(
            episodes, kl_estimator=hp.kl_estimator, kl_clamp=hp.kl_clamp, kl_coef=kl_coef, whiten=hp.whiten_rewards,
            turn_weight=parts.turn_weight, teacher_coef=self.config.teacher_coef)

        # 5. advantages
        episodes.advantages, episodes.returns = experience.advantages(
            hp.estimator, episodes, gamma=hp.gamma, lam=hp.lam, whiten=hp.whiten_advantages, group_size=n,
            grpo_scale_std=hp.grpo_scale_std, all_reduce=reduce)

        # 6. optimise
        lrs = parts.scheduler.get_last_lr()
        train_stats = self.optimise(experience.trained_on(episodes, mask_truncated_completions=hp.mask_truncated_completions))
        t_train = time.perf_counter()

        # 7. log
        state.count_done(parts.sizes.batch)
        objective = objective_metrics(episodes, kl, non_score, episodes.valid, kl_coef, reduce)
        parts.kl_controller.update(objective["objective/kl"], parts.sizes.batch)
        elapsed = t_train - t0
        record = {
            "update": state.update, "episode": state.episodes_sampled, **objective, **mismatch, **train_stats, **scored.metrics, **ahead, "lr": lrs[0],
            **({"lr/value": lrs[1]} if hp.vf_learning_rate is not None or hp.critic_warmup_updates else {}),
            "eps": parts.sizes.batch / elapsed, "time/generation": t_generate - t0, "time/scoring": t_score - t_generate,
            "time/forward": t_forward - t_score, "time/training": t_train - t_forward, "time/update": elapsed,
        }
        self._last_batch = evaluation.scored_rows(prompts, columns, scored, episodes, episodes.valid)
        return record

    def optimise(self, episodes: Episodes) -> dict[str, float]:
        """num_ppo_epochs passes over minibatches (ppokit.training.optimise) -> the loss statistics; the first critic_warmup_updates
        move only the critic. The engine gives its memory to the training meanwhile and is sent the new weights after."""
        parts, hp = self.parts, self.config.ppo
        with self.sampler.training(parts.policy):
            return ppo_epochs(parts.model, parts.optimizer, parts.scheduler, episodes, hp, parts.sizes, parts.strategy, parts.reduce,
                              train_policy=self.state.update >= hp.critic_warmup_updates,
                              on_skipped_step=lambda bad: self._progress(f"update {self.state.update + 1}: an optimiser step skipped, {bad}"))

    def _progress(self, line: str) -> None:
        """A line on the run's progress for the user: stderr, main process only."""
        if self.show_progress:
            print(line, file=sys.stderr)

    # ------------------------------------------------------------------ the run

    def train(self) -> list[dict]:
        """Run every update; write the run directory. Returns the list of metric records."""
        try:
            self._train()
        except (OSError, RuntimeError) as e:  # a full disk; another process gone
            last = self.saving.last_checkpoint
            said = (run_dir.full_disk(e, self.saving.files(), last) or parallel.lost_process(e, self.accelerator, last)
                    or engines.base.engine_lost(e, last))
            if said is None:
                raise
            raise said from None
        finally:
            self.sampler.close()
            self.rollout_engine.close()
            self.saving.close()
        return self.state.records

    def _train(self) -> None:
        hp, state, is_main = self.config.ppo, self.state, self.accelerator.is_main_process
        files = self.saving.folder(self.parts).start(fresh=state.update == 0, overwrite=self.saving.overwrite, barrier=self.accelerator.wait_for_everyone)
        parallel.check_shared_folder(files, self.accelerator)
        if is_main:
            self.config.save(files / "config.yaml")
        # A resumed run's files were rewritten to the checkpoint's by resume_from; they continue from there.
        sinks = open_sinks(self.config, total_updates=self.sizes.num_updates, done_updates=state.update, is_main=is_main,
                           show_progress=self.show_progress, folder=files, output_dir=self.saving.output_dir)
        sample_every = max(1, self.sizes.num_updates // hp.num_sample_generations) if hp.num_sample_generations else 0
        if sample_every and state.update == 0 and self.eval_data is not None:
            sinks.samples(self._saved_if_it_fails(self.samples_before_training))  # the baseline the later generations compare with
        signals = StopSignals(lambda: self.saving.last_checkpoint, lambda: state.update, self.accelerator).install()
        # Set-up allocated many long-lived objects; freezing them keeps each gc pass short.
        gc.collect()
        gc.freeze()
        try:
            while state.update < self.sizes.num_updates:
                record = self._saved_if_it_fails(self.run_update)
                last = state.update == self.sizes.num_updates
                if sample_every and not state.skipped_in_a_row and (state.update % sample_every == 0 or last):
                    rows = self._saved_if_it_fails(self.sample_completions, record)
                    record.update(evaluation.eval_score(rows, evaluation.EvalSamples.of(hp)))
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

    def _saved_if_it_fails(self, part: Callable, finished_record: Optional[dict] = None):  # guards.saved_if_it_fails, this run's
        return saved_if_it_fails(part, self.state, self.save_checkpoint, finished_record,
                                 alone=lambda error: self.accelerator.num_processes > 1 and not isinstance(error, parallel.EveryProcessStops))

    def run_update(self) -> dict[str, Any]:
        """`step` under the non-finite guard (`guards.guarded_update`): an update with a non-finite score, loss or
        gradient is rolled back to its start, counted in `skipped_updates` and logged as `nonfinite/<quantity>`."""
        hp, started = self.config.ppo, time.perf_counter()
        snapshot = UpdateSnapshot(self.model, self.optimizer, self.scheduler, hp.rollback,
                                  rollback_file(self.saving.files(), self.accelerator.process_index))
        return guarded_update(self.step, snapshot, self.state, optimiser_steps=hp.num_ppo_epochs * hp.num_mini_batches,
                              episodes=self.sizes.batch, rolled_back=hp.rollback != "off", started=started, say=self._progress)

    def _stop_if_asked(self, signals: StopSignals) -> None:
        """After an update: stop with a checkpoint after too many non-finite updates or on SIGINT/SIGTERM."""
        hp, state = self.config.ppo, self.state
        if state.skipped_in_a_row >= hp.max_skipped_updates:
            raise too_many_skipped(state, hp, self.save_checkpoint())
        signum = signals.requested()
        if signum and state.update < self.sizes.num_updates:
            raise TrainingInterrupted(signum, state.update, self.save_checkpoint())

    # ------------------------------------------------------------------ resume, evaluate, save

    def resume_from(self, path: str | Path | None = None, force: bool = False) -> Path:
        """Continue from checkpoint `path` (default: the latest complete one in output_dir/checkpoints); call train() next. Restores
        weights, optimiser, schedule, KL controller, reward-source state, RNG states, counters, metrics. A config that would change the result is refused unless
        `force`."""
        self.state, path = self.saving.resume(self.parts, path, force)
        self.rollout_engine.sync_weights(self.policy)
        return path

    def evaluate(self, max_prompts: Optional[int] = None, seed: Optional[int] = None) -> dict[str, float]:
        """Sample completions for the eval prompts (all, or the first `max_prompts`) with the current policy, score them ->
        `eval/scores`, `eval/response_length`, `eval/ended` (share that produced the stop token), `eval/num_scored`, and with
        ppo.eval_pass_at_k `eval/pass@k` and `eval/mean@n` over ppo.eval_samples_per_prompt samples per prompt. Sampled
        at `ppo.eval_temperature` (0: greedy) with a generator of its own seeded with `seed` (default `config.seed`):
        repeatable, training's random stream left as it was. Reward normalisation statistics are not updated."""
        return evaluation.evaluate(self.rollout, self.eval_data, self.eval_query_ids, max_prompts=max_prompts,
                                   seed=self.config.seed if seed is None else seed,
                                   rows_per_call=self.config.ppo.local_rollout_forward_batch_size, device=self.accelerator.device,
                                   samples=evaluation.EvalSamples.of(self.config.ppo))

    def sample_completions(self) -> list[dict]:
        """Completions for a few eval prompts (or the current batch), scored, as samples.jsonl rows (score None: unscored)."""
        rows = evaluation.sample_rows(self.rollout, self.eval_data, self.eval_query_ids, self.config.ppo.num_eval_samples, self._last_batch,
                                      evaluation.EvalSamples.of(self.config.ppo), update=self.state.update, episode=self.state.episodes_sampled)
        if self.state.update == 0 and self.eval_data is not None:
            self._samples_before = rows
        return rows

    def samples_before_training(self) -> list[dict]:
        """The eval samples before the first update, which train() writes first: a `sample_completions()` call's before
        train(), else drawn now with every random state kept (the run's results stay those it would have without them)."""
        if self._samples_before is None:
            with random_states.kept():
                self.sample_completions()
        return self._samples_before

    def save_checkpoint(self) -> Path:
        """The whole training state in output_dir/checkpoints/update-N/ (see ppokit.run.checkpoint), once per update."""
        return self.saving.checkpoint(self.parts, self.state)

    def save_final(self) -> Path:
        """policy + tokenizer + model card in final/, the value model (with the tokenizer, if there is one) in final/value_model/, whole."""
        return self.saving.final(self.parts, self.state)

    def save_models(self, target: Path, **options) -> None:
        """Policy, tokenizer and value model as loadable folders (`saving.Saving.models`: merged, kind, replace_unmarked, card)."""
        self.saving.models(self.parts, target, **options)
