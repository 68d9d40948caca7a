"""PPOTrainer: one update is a sequence of numbered stages, readable top to bottom in `step`.

    1. generate   sample a response for each prompt of the batch (KV cache, stop token)
    2. score      reward sources on prompt + completion text (and token ids)
    3. forward    reference logprobs and values for every response token
    4. reward     per-token KL penalty plus the score at the last real token
    5. advantages GAE, then whitening
    6. optimise   num_ppo_epochs passes of clipped policy + value loss over minibatches
    7. log        metrics.jsonl, console, samples.jsonl
    8. save       checkpoint every save_steps, final model at the end
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

from ppokit import algo, checkpoint, roles
from ppokit.checkpoint import atomic_save_dir
from ppokit.config import PPOConfig
from ppokit.data import PromptDataset, as_prompt_dataset, render_chat_prompts
from ppokit.errors import UserError
from ppokit.guards import (
    NonFiniteStop,
    NonFiniteUpdate,
    StopSignals,
    TrainingInterrupted,
    UpdateSnapshot,
    check_finite,
    check_some_scored,
    gradient_norm,
)
from ppokit.metrics import ConsoleReporter, JsonlWriter
from ppokit.models import (
    disable_dropout,
    ensure_pad_token,
    frozen_copy,
    left_pad,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    response_logits,
    scalar_outputs,
    value_model_from_policy,
)
from ppokit.rewards import RewardModelReward, ScoringBatch, build_scorer, completion_token_ids, source_label
from ppokit.rollout import HFSampler, Rollout


class PolicyAndValue(nn.Module):
    """Policy and value model under one module, so one optimiser and one `prepare` cover both."""

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    def forward(self, input_ids, attention_mask, response_length: int):
        """(B, P + R) -> (logits (B, R, V) predicting each response token, values (B, R))."""
        logits = response_logits(self.policy, input_ids, attention_mask, response_length)
        values = scalar_outputs(self.value_model, input_ids, attention_mask)[:, -response_length - 1 : -1]
        return logits, values


class PPOTrainer:
    """Train a causal LM with PPO against one or more reward sources.

    Args:
        config: a PPOConfig (paths in it are used for anything not passed as an object).
        model: policy, a `PreTrainedModel` or a path/hub id; default `config.model`.
        tokenizer: the policy's tokenizer; default loaded from `config.tokenizer` or the model path.
        ref_model: frozen reference; default `config.ref_model`, else a frozen copy of the policy.
        value_model: one-label sequence classifier; default `config.value_model`, else the reward
            model's weights, else the policy's backbone with a fresh zero head.
        reward_model: one-label sequence classifier (object or path); default `config.reward.model`.
        reward_tokenizer: the reward model's tokenizer when it is passed as an object.
        reward_functions: callables fn(prompts, completions, **columns) -> list[float], reward
            sources (objects with `name` and `score(ScoringBatch)`, e.g. `RemoteReward`), or entries
            as in `reward.functions`; they replace `config.reward.functions`.
        train_dataset / eval_dataset: a path, a list of prompts or row dicts, or a `datasets.Dataset`.
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
    ):
        if model is not None and config.model is None:
            config.model = getattr(getattr(model, "config", None), "_name_or_path", None) or "<object>"
        if reward_functions is not None:
            config.reward.functions = [source_label(f) for f in reward_functions]
        if reward_model is not None and config.reward.model is None:
            config.reward.model = "<object>"
        self.config = config.validate()
        hp = config.ppo
        roles.check_environment(config)  # before any weights load
        self.accelerator = accelerator or Accelerator(mixed_precision=roles.mixed_precision(config))
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and self.accelerator.num_processes != launched:
            # Every process would believe it is the only one and write the same run directory.
            raise UserError(
                f"launched as {launched} processes (WORLD_SIZE) but accelerate sees {self.accelerator.num_processes}; "
                "on CPU set ACCELERATE_USE_CPU=true for torchrun, or start with `accelerate launch`"
            )
        set_seed(config.seed)
        self.output_dir = Path(config.output_dir)
        self.show_progress = show_progress and self.accelerator.is_main_process

        # Data first: a bad file should fail before any weights are loaded.
        self.train_data: PromptDataset = as_prompt_dataset(
            train_dataset if train_dataset is not None else _required(config.data.train, "data.train"),
            config.data.prompt_field,
            config.data.format,
        )
        if eval_dataset is not None and config.data.eval_fraction:
            raise UserError("data.eval_fraction holds out training prompts for evaluation, but eval_dataset is given too; use one of them")
        eval_source = eval_dataset if eval_dataset is not None else config.data.eval
        self.eval_data: Optional[PromptDataset] = (
            as_prompt_dataset(eval_source, config.data.prompt_field, config.data.format) if eval_source is not None else None
        )
        if self.eval_data is None and config.data.eval_fraction:
            self.train_data, self.eval_data = self.train_data.split(config.data.eval_fraction, config.seed)
        self.sizes = hp.derive(self.accelerator.num_processes, len(self.train_data))

        # Models.
        trc = config.trust_remote_code
        load_kwargs = roles.load_kwargs(config)
        self.tokenizer = ensure_pad_token(tokenizer) if tokenizer is not None else load_tokenizer(
            config.tokenizer or _path_of(model, config.model), trc, "tokenizer" if config.tokenizer else "model"
        )
        # Chat prompts become text with the tokenizer's template; the run's config records which.
        template = render_chat_prompts(self.tokenizer, config.data.chat_template, self.train_data, self.eval_data)
        if template is not None:
            config.data.chat_template = template
        data_columns = {f"data.train ({self.train_data.source})": set(self.train_data.columns)}
        if self.eval_data is not None:
            data_columns[f"data.eval ({self.eval_data.source})"] = set(self.eval_data.columns)
        self.scorer = build_scorer(
            config.reward, missing_eos_penalty=hp.missing_eos_penalty, reward_model=reward_model,
            reward_tokenizer=reward_tokenizer, reward_functions=reward_functions, trust_remote_code=trc, base_dir=Path.cwd(),
            all_reduce=self._sum_over_processes if self.accelerator.num_processes > 1 else None, load_kwargs=load_kwargs,
            data_columns=data_columns,
        )
        policy = load_causal_lm(model if model is not None else config.model, "model", trc, **load_kwargs)
        if ref_model is not None or config.ref_model:
            ref = load_causal_lm(ref_model if ref_model is not None else config.ref_model, "ref_model", trc)
            ref.requires_grad_(False)
        elif config.lora is not None:
            ref = None  # the policy's base with its adapter disabled: see reference_logits
        else:
            ref = frozen_copy(policy)
        reward_model_obj = self.scorer.reward_model
        value_lora = config.lora is not None and config.lora.value_model_lora
        if config.value_model == "from_reward" and not (
            reward_model_obj is not None and self.scorer.reward_model_shares_vocabulary(self.tokenizer)
        ):
            raise UserError("value_model: from_reward needs reward.model with the policy's vocabulary (the critic reads the policy's token ids)")
        if config.value_model == "shared":
            value = None  # an adapter on the policy's base, added with the policy's below
        elif value_model is not None or (config.value_model and config.value_model != "from_reward"):
            value = load_scalar_model(value_model if value_model is not None else config.value_model, "value_model", trc,
                                      **(load_kwargs if value_lora else {}))
        elif reward_model_obj is not None and config.value_model == "from_reward" and value_lora:
            value = reward_model_obj  # one copy of the reward weights: the critic's adapter goes on it
        elif reward_model_obj is not None and self.scorer.reward_model_shares_vocabulary(self.tokenizer):
            value = frozen_copy(reward_model_obj).train().requires_grad_(True)
        elif config.quantization is not None:
            value = roles.value_model_from_path(config.model, trc, load_kwargs if value_lora else {})
        else:
            value = value_model_from_policy(policy)
        for m in (policy, ref, value, reward_model_obj):
            if m is not None:
                disable_dropout(m)
        # Adapters after disable_dropout, so that lora.dropout is the one dropout left on purpose.
        if config.lora is not None:
            if value is not None and value_lora:
                value = roles.add_value_adapter(value, config)
                if value.get_base_model() is reward_model_obj:
                    self.scorer.sources = [roles.AdapterDisabledReward(s, value) if isinstance(s, RewardModelReward) else s
                                           for s in self.scorer.sources]
            policy = roles.add_policy_adapter(policy, config)
            if value is None:
                value = roles.SharedBaseCritic(policy, config)
        if config.gradient_checkpointing:
            shared = policy if config.value_model == "shared" else None
            roles.enable_gradient_checkpointing(policy, shared)
            if shared is None:
                roles.enable_gradient_checkpointing(value)
        self.stop_token_id = self._resolve_stop_token()

        # Optimiser and schedule over every optimiser step of the run.
        self.model = PolicyAndValue(policy, value)
        self.model.train()
        steps = self.sizes.num_updates * hp.num_ppo_epochs * hp.num_mini_batches
        optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=hp.learning_rate,
            eps=hp.adam_epsilon,
            weight_decay=hp.weight_decay,
            fused=_fused_adamw_supported(),  # one kernel per step instead of a loop of small ones
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(hp.lr_scheduler_type, hp.warmup_steps, steps))
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(self.model, optimizer, scheduler)
        device = self.accelerator.device
        self.ref_model = ref.to(device).eval() if ref is not None else None
        if reward_model_obj is not None:
            reward_model_obj.to(device).eval()
        self.kl_controller = (
            algo.AdaptiveKLController(hp.kl_coef, hp.kl_target, hp.kl_horizon)
            if hp.kl_target is not None
            else algo.FixedKLController(hp.kl_coef)
        )

        self.train_query_ids = self._tokenize_prompts(self.train_data, "data.train")
        self.eval_query_ids = self._tokenize_prompts(self.eval_data, "data.eval") if self.eval_data else None
        self.update = 0
        self.episode = 0
        # Resume state (ppokit.checkpoint saves and restores all of it with the models and optimiser).
        self.records: list[dict] = []  # metric records of every update so far
        self.skipped_updates = 0  # updates rolled back for a non-finite score, loss or gradient
        self.skipped_in_a_row = 0
        self.last_nonfinite: Optional[NonFiniteUpdate] = None
        self._saved_at: Optional[tuple[int, Path]] = None  # (update, path) of the last checkpoint written
        self._last_batch: tuple[list, list, list] = ([], [], [])  # prompts, completions, scores of the last update

    # ------------------------------------------------------------------ set-up helpers

    def _sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor.to(self.accelerator.device), reduction="sum").cpu()

    def _resolve_stop_token(self) -> Optional[int]:
        hp, tok = self.config.ppo, self.tokenizer
        if hp.stop_token_id is not None:
            if hp.stop_token_id >= len(tok):
                raise UserError(f"ppo.stop_token_id {hp.stop_token_id} is outside the vocabulary ({len(tok)} tokens)")
            return hp.stop_token_id
        if hp.stop_token is None:
            return None
        if hp.stop_token == "eos":
            if tok.eos_token_id is None:
                raise UserError("ppo.stop_token is 'eos' but the tokenizer has no EOS token; set ppo.stop_token_id")
            return tok.eos_token_id
        ids = tok.convert_tokens_to_ids([hp.stop_token])
        if ids[0] is None or ids[0] == tok.unk_token_id:
            encoded = tok(hp.stop_token, add_special_tokens=False)["input_ids"]
            if len(encoded) != 1:
                raise UserError(f"ppo.stop_token {hp.stop_token!r} is {len(encoded)} tokens; it must be exactly one")
            if encoded[0] == tok.unk_token_id and hp.stop_token != tok.unk_token:
                raise UserError(f"ppo.stop_token {hp.stop_token!r} is not in the tokenizer's vocabulary (it encodes as {tok.unk_token!r})")
            ids = encoded
        return ids[0]

    def _tokenize_prompts(self, data: PromptDataset, key: str) -> list[list[int]]:
        limit = self.config.data.max_prompt_length
        encoded, truncated = [], 0
        for i, prompt in enumerate(data.prompts):
            ids = self.tokenizer(prompt)["input_ids"]
            if not ids:
                raise UserError(f"{data.source}: row {i}: the prompt encodes to no tokens")
            if limit is not None and len(ids) > limit:
                ids = ids[-limit:]  # keep the end: it is what the response continues
                truncated += 1
            encoded.append(ids)
        if truncated and self.show_progress:
            print(f"{key}: {truncated} of {len(encoded)} prompts longer than data.max_prompt_length={limit} were truncated from the left")
        return encoded

    # ------------------------------------------------------------------ data order

    def batch_indices(self, update: int) -> list[int]:
        """Prompt indices of update `update` (0-based): a seeded shuffle per pass over the data."""
        n, batch = len(self.train_data), self.sizes.batch
        start = update * batch
        indices = []
        while len(indices) < batch:
            epoch, offset = divmod(start + len(indices), n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.config.seed + epoch)).tolist()
            indices.extend(order[offset : offset + batch - len(indices)])
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        return indices[rank::world]

    # ------------------------------------------------------------------ one update

    @property
    def policy(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model).policy

    @property
    def value_model(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model).value_model

    def _sampler(self) -> HFSampler:
        hp = self.config.ppo
        return HFSampler(
            self.policy, hp.response_length, hp.temperature, self.stop_token_id, self.tokenizer.pad_token_id,
            hp.local_rollout_forward_batch_size,
        )

    def generate(self, query_ids: list[list[int]]) -> Rollout:
        ids, mask = left_pad(query_ids, self.tokenizer.pad_token_id, self.accelerator.device)
        self.policy.eval()
        with self.accelerator.autocast():  # the same precision as the training forward, so the first ratio is 1
            rollout = self._sampler().sample(ids, mask)
        self.policy.train()
        return rollout

    def score(self, rollout: Rollout, prompts: list[str], columns: dict, update_statistics: bool = True) -> tuple[torch.Tensor, dict]:
        """-> (scores (B,), {completions, valid (B,) bool: False where a source failed under
        reward.on_error=skip, errors: the first message of each failed source, metrics}).
        Evaluation passes update_statistics=False so it does not move the reward normalisation."""
        completions = self.tokenizer.batch_decode(
            rollout.response_ids.masked_fill(~rollout.response_mask, self.tokenizer.pad_token_id),
            skip_special_tokens=True,
        )
        batch = ScoringBatch(
            prompts, completions, columns, rollout.input_ids, rollout.attention_mask, self.tokenizer,
            completion_ids=completion_token_ids(rollout.response_ids, rollout.response_mask, self.stop_token_id),
            ended=rollout.ended.cpu() if self.stop_token_id is not None else None,
        )
        result = self.scorer.score(batch, update_statistics)
        device = self.accelerator.device
        return result.scores.to(device), {
            "completions": completions, "valid": result.valid.to(device), "errors": result.errors, "metrics": self.scorer.metrics(result),
        }

    @torch.inference_mode()
    def reference_and_values(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference logprobs and values for every response token, in forward-size chunks."""
        hp, chunk = self.config.ppo, self.config.ppo.local_rollout_forward_batch_size
        ids, mask = rollout.input_ids, rollout.attention_mask
        width = rollout.response_ids.shape[1]
        ref_logprobs, values = [], []
        self.value_model.eval()
        for i in range(0, ids.shape[0], chunk):
            logits = self.reference_logits(ids[i : i + chunk], mask[i : i + chunk], width)
            ref_logprobs.append(algo.logprobs_from_logits(logits, rollout.response_ids[i : i + chunk], hp.temperature))
            with self.accelerator.autocast():
                values.append(scalar_outputs(self.value_model, ids[i : i + chunk], mask[i : i + chunk])[:, -width - 1 : -1])
        self.value_model.train()
        response_mask = rollout.response_mask
        return torch.cat(ref_logprobs).masked_fill(~response_mask, 0.0), torch.cat(values).masked_fill(~response_mask, 0.0)

    def reference_logits(self, input_ids, attention_mask, response_length: int) -> torch.Tensor:
        """(B, P + R) -> (B, R, V) from the reference: its own model, or the LoRA policy's base with adapters off."""
        with self.accelerator.autocast():
            if self.ref_model is not None:
                return response_logits(self.ref_model, input_ids, attention_mask, response_length)
            with roles.adapters_disabled(self.policy):
                return response_logits(self.policy, input_ids, attention_mask, response_length)

    def optimise(self, rollout: Rollout) -> dict[str, float]:
        """num_ppo_epochs passes over shuffled minibatches; returns the averaged loss statistics."""
        hp, sizes = self.config.ppo, self.sizes
        width = rollout.response_ids.shape[1]
        stats: dict[str, list[torch.Tensor]] = {k: [] for k in ("approxkl", "clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio")}
        # A micro-batch whose rows were all dropped (reward.on_error=skip) has no tokens: its statistics
        # are 0 by convention, not measurements, so it is left out of the averages (ratio 0 would read as a collapse).
        has_tokens: list[torch.Tensor] = []
        for _ in range(hp.num_ppo_epochs):
            order = torch.randperm(len(rollout), device=rollout.query_ids.device)
            for mb_start in range(0, len(rollout), sizes.local_mini_batch):
                minibatch = order[mb_start : mb_start + sizes.local_mini_batch]
                micro_batches = minibatch.split(sizes.micro_batch)
                step_loss = torch.zeros((), device=rollout.query_ids.device)
                for k, micro in enumerate(micro_batches):
                    mb = rollout.select(micro)
                    sync = k == len(micro_batches) - 1
                    context = self.accelerator.no_sync(self.model) if not sync else contextlib.nullcontext()
                    with context:
                        logits, new_values = self.model(mb.input_ids, mb.attention_mask, width)
                        new_logprobs, token_entropy = algo.logprobs_and_entropy(logits, mb.response_ids, hp.temperature)
                        pg_loss, pg_stats = algo.clipped_policy_loss(
                            new_logprobs, mb.logprobs, mb.advantages, mb.response_mask, hp.cliprange
                        )
                        vf_loss, vf_clipfrac = algo.clipped_value_loss(
                            new_values, mb.values, mb.returns, mb.response_mask, hp.cliprange_value
                        )
                        loss = (pg_loss + hp.vf_coef * vf_loss) / len(micro_batches)
                        self.accelerator.backward(loss)
                    step_loss = step_loss + loss.detach()
                    entropy = algo.masked_mean(token_entropy, mb.response_mask)
                    for key, value in (
                        ("approxkl", pg_stats.approxkl), ("clipfrac", pg_stats.clipfrac), ("ratio", pg_stats.ratio),
                        ("pg_loss", pg_loss.detach()), ("vf_loss", vf_loss.detach()), ("vf_clipfrac", vf_clipfrac),
                        ("entropy", entropy),
                    ):
                        stats[key].append(value)
                    has_tokens.append(mb.response_mask.any())
                grad_norm = None
                if hp.max_grad_norm > 0:
                    grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), hp.max_grad_norm)
                # Checked before the step: a non-finite loss or gradient must never reach the weights.
                check_finite("loss", step_loss, self.accelerator)
                check_finite("gradient", grad_norm if grad_norm is not None else gradient_norm(self.model.parameters()), self.accelerator)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
        return self._training_metrics(stats, has_tokens)

    def _training_metrics(self, stats: dict[str, list[torch.Tensor]], has_tokens: list[torch.Tensor]) -> dict[str, float]:
        """Means over the micro-batches that had real tokens, on every process together (one reduction)."""
        names = list(stats)
        per_micro_batch = torch.stack([torch.stack(stats[k]).float() for k in names])  # (statistics, micro-batches)
        weight = torch.stack(has_tokens).float()
        ratio = per_micro_batch[names.index("ratio")]
        sums = torch.cat([(per_micro_batch * weight).sum(1), (ratio**2 * weight).sum().reshape(1), weight.sum().reshape(1)])
        if self.accelerator.num_processes > 1:
            sums = self.accelerator.reduce(sums, reduction="sum")
        *totals, ratio_sq, count = sums.tolist()
        mean = {k: t / max(count, 1) for k, t in zip(names, totals)}
        # Unbiased variance over micro-batches, as torch.var computes it.
        ratio_var = max(ratio_sq - count * mean["ratio"] ** 2, 0.0) / (count - 1) if count > 1 else 0.0
        return {
            "policy/approxkl_avg": mean["approxkl"],
            "policy/clipfrac_avg": mean["clipfrac"],
            "loss/policy_avg": mean["pg_loss"],
            "loss/value_avg": mean["vf_loss"],
            "val/clipfrac_avg": mean["vf_clipfrac"],
            "policy/entropy_avg": mean["entropy"],
            "val/ratio": mean["ratio"],
            "val/ratio_var": ratio_var,
        }

    def _objective_metrics(
        self, rollout: Rollout, kl: torch.Tensor, non_score: torch.Tensor, kept: torch.Tensor, kl_coef: float
    ) -> dict[str, float]:
        """objective/* and val/num_eos_tokens: means over the episodes kept in the update (rows dropped by
        reward.on_error=skip count in none of them), over every process (one reduction), so that the
        adaptive KL controller moves the same way on all of them."""
        mask = rollout.response_mask  # already False on dropped rows
        keep = kept.float()
        non_score_sum = non_score.sum(1)
        sums = torch.stack([
            keep.sum(),
            kl.sum(),
            (-rollout.logprobs * mask).sum(),
            non_score_sum.sum(),
            (rollout.scores * keep).sum(),
            mask.sum().float(),
            (rollout.ended & kept).sum().float(),
        ])
        if self.accelerator.num_processes > 1:
            sums = self.accelerator.reduce(sums, reduction="sum")
        episodes, kl_sum, neg_logprob_sum, non_score_total, score_sum, tokens, ended = sums.tolist()
        n = max(episodes, 1.0)
        return {
            "objective/scores": score_sum / n,
            "objective/kl": kl_sum / n,
            "objective/entropy": neg_logprob_sum / n,
            "objective/non_score_reward": non_score_total / n,
            "objective/rlhf_reward": (score_sum + non_score_total) / n,
            "objective/kl_coef": kl_coef,
            "objective/response_length": tokens / n,
            "val/num_eos_tokens": int(ended),
        }

    def step(self) -> dict[str, Any]:
        """Run one PPO update and return its metrics."""
        if self.update >= self.sizes.num_updates:
            raise UserError(
                f"all {self.sizes.num_updates} updates of ppo.total_episodes={self.sizes.total_episodes} are done; "
                "raise ppo.total_episodes to train further"
            )
        hp = self.config.ppo
        t0 = time.perf_counter()
        indices = self.batch_indices(self.update)
        prompts, columns = self.train_data.rows(indices)

        # 1. generate
        rollout = self.generate([self.train_query_ids[i] for i in indices])
        t_generate = time.perf_counter()

        # 2. score
        rollout.scores, extras = self.score(rollout, prompts, columns)
        rollout.response_mask = rollout.response_mask & extras["valid"].unsqueeze(1)  # failed rows (on_error: skip) leave the update
        check_finite("score", rollout.scores, self.accelerator)
        check_some_scored(extras["valid"], extras["errors"], self.accelerator)
        t_score = time.perf_counter()

        # 3. forward: reference logprobs and values
        rollout.ref_logprobs, rollout.values = self.reference_and_values(rollout)
        t_forward = time.perf_counter()

        # 4. reward: per-token KL penalty, score at the last real token
        mask = rollout.response_mask
        kl = algo.kl_per_token(rollout.logprobs, rollout.ref_logprobs, hp.kl_estimator) * mask
        rollout.rewards, non_score = algo.shape_rewards(rollout.scores, kl, mask, self.kl_controller.value)
        if hp.whiten_rewards:
            rollout.rewards = algo.masked_whiten(rollout.rewards, mask, shift_mean=False)

        # 5. advantages
        rollout.advantages, rollout.returns = algo.gae(rollout.rewards, rollout.values, mask, hp.gamma, hp.lam)
        if hp.whiten_advantages:
            rollout.advantages = algo.masked_whiten(rollout.advantages, mask)

        # 6. optimise
        lr = self.scheduler.get_last_lr()[0]
        train_stats = self.optimise(rollout)
        t_train = time.perf_counter()

        # 7. log
        self.update += 1
        self.episode += self.sizes.batch
        objective = self._objective_metrics(rollout, kl, non_score, extras["valid"], self.kl_controller.value)
        self.kl_controller.update(objective["objective/kl"], self.sizes.batch)
        elapsed = t_train - t0
        record = {
            "update": self.update,
            "episode": self.episode,
            **objective,
            **train_stats,
            **extras["metrics"],
            "lr": lr,
            "eps": self.sizes.batch / elapsed,
            "time/generation": t_generate - t0,
            "time/scoring": t_score - t_generate,
            "time/forward": t_forward - t_score,
            "time/training": t_train - t_forward,
            "time/update": elapsed,
        }
        self._last_batch = (prompts, extras["completions"], _scores_or_none(rollout.scores, extras["valid"]))
        return record

    # ------------------------------------------------------------------ the run

    def train(self) -> list[dict]:
        """Run every update; write the run directory. Returns the list of metric records."""
        hp = self.config.ppo
        out = self.output_dir
        is_main = self.accelerator.is_main_process
        if is_main:
            out.mkdir(parents=True, exist_ok=True)
            self.config.save(out / "config.yaml")
            if self.update == 0 and (removed := checkpoint.remove_checkpoints(out)) and self.show_progress:
                print(f"{out}: removed {removed} checkpoint(s) of an earlier run; this fresh run replaces it")
        resumed = self.update > 0  # resume_from rewrote metrics.jsonl and samples.jsonl to the checkpoint's
        metrics = JsonlWriter(out / "metrics.jsonl", append=resumed) if is_main else None
        samples = JsonlWriter(out / "samples.jsonl", append=resumed) if is_main else None
        reporter = ConsoleReporter(self.sizes.num_updates, initial=self.update, enabled=self.show_progress)
        sample_every = max(1, self.sizes.num_updates // hp.num_sample_generations) if hp.num_sample_generations else 0
        records = self.records
        signals = StopSignals(self).install()
        # Set-up allocated many long-lived objects; freezing them keeps each gc pass short.
        gc.collect()
        gc.freeze()
        try:
            while self.update < self.sizes.num_updates:
                record = self.run_update()
                if sample_every and not self.skipped_in_a_row and (self.update % sample_every == 0 or self.update == self.sizes.num_updates):
                    rows = self.sample_completions()
                    scored = [r["score"] for r in rows if r["score"] is not None]
                    if scored and self.eval_data is not None:  # without eval data the rows are the training batch's
                        record["eval/scores"] = sum(scored) / len(scored)
                    if samples:
                        samples.write_many(rows)
                records.append(record)
                if metrics:
                    metrics.write(record)
                reporter.update(record, print_line=self.update % hp.logging_steps == 0 or self.update == self.sizes.num_updates)
                if hp.save_steps and self.update % hp.save_steps == 0 and self.update < self.sizes.num_updates:
                    self.save_checkpoint()
                self._stop_if_asked(signals)
        finally:
            signals.uninstall()
            reporter.close()
            gc.unfreeze()
            for sink in (metrics, samples):
                if sink:
                    sink.close()
        self.save_checkpoint()
        self.save_final()
        return records

    def run_update(self) -> dict[str, Any]:
        """`step` under the non-finite guard. An update whose score, loss or gradient is NaN or infinite is
        rolled back to its start (ppokit.guards.UpdateSnapshot), counted in `skipped_updates` and logged
        as `nonfinite/<quantity>`; its batch is not retried (the data position moves on)."""
        hp = self.config.ppo
        t0 = time.perf_counter()
        snapshot = UpdateSnapshot(self.model, self.optimizer, self.scheduler, weights=hp.nonfinite_rollback)
        try:
            record = self.step()
        except NonFiniteUpdate as bad:
            snapshot.restore(scheduler_steps=hp.num_ppo_epochs * hp.num_mini_batches)
            self.model.train()
            self.update += 1
            self.episode += self.sizes.batch
            self.skipped_updates += 1
            self.skipped_in_a_row += 1
            self.last_nonfinite = bad
            if self.show_progress:
                print(f"update {self.update}: skipped and rolled back, {bad}", file=sys.stderr)
            return {
                "update": self.update, "episode": self.episode, f"nonfinite/{bad.quantity}": 1,
                "skipped_updates": self.skipped_updates, "time/update": time.perf_counter() - t0,
            }
        self.skipped_in_a_row = 0
        record["skipped_updates"] = self.skipped_updates
        return record

    def _stop_if_asked(self, signals: StopSignals) -> None:
        """After an update: stop with a checkpoint after too many non-finite updates or on SIGINT/SIGTERM."""
        hp = self.config.ppo
        if self.skipped_in_a_row >= hp.max_skipped_updates:
            path = self.save_checkpoint()
            raise NonFiniteStop(
                f"update {self.update}: {self.skipped_in_a_row} updates in a row were skipped "
                f"(ppo.max_skipped_updates={hp.max_skipped_updates}), the last for a {self.last_nonfinite}. "
                f"The checkpoint {path} holds the last good weights; fix the cause (reward, learning rate, data) "
                "and continue with --resume"
            )
        signum = signals.requested()
        if signum and self.update < self.sizes.num_updates:
            raise TrainingInterrupted(signum, self.update, self.save_checkpoint())

    def resume_from(self, path: str | Path | None = None, force: bool = False) -> Path:
        """Continue from checkpoint `path` (default: the latest complete one in output_dir/checkpoints);
        call train() next. Restores weights, optimiser, schedule, KL controller, reward-source state,
        RNG states, counters and metrics. A config that would change the result is refused unless `force`."""
        path = checkpoint.find_checkpoint(str(path) if path is not None else None, self.output_dir)
        say = (lambda m: print(f"ppokit: {m}", file=sys.stderr)) if self.accelerator.is_main_process else (lambda m: None)
        checkpoint.load_checkpoint(self, path, force=force, say=say)
        own = checkpoint.checkpoints_dir(self.output_dir) / f"update-{self.update}"
        if own.exists() and own.resolve() == path.resolve():
            self._saved_at = (self.update, path)
        return path

    @torch.inference_mode()
    def evaluate(self, max_prompts: Optional[int] = None, seed: Optional[int] = None) -> dict[str, float]:
        """Sample completions for the eval prompts (all of them, or the first `max_prompts`) with the
        current policy, score them, and return `eval/scores`, `eval/response_length`, `eval/ended`
        (share of responses that produced the stop token) and `eval/num_scored`.

        Sampling uses its own generator seeded with `seed` (default `config.seed`), so the result is
        repeatable and training's random stream is left as it was. Reward normalisation statistics
        are not updated.
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
                rows = range(start, min(n, start + chunk))
                prompts, columns = self.eval_data.rows(rows)
                rollout = self.generate([self.eval_query_ids[i] for i in rows])
                batch_scores, extras = self.score(rollout, prompts, columns, update_statistics=False)
                valid = extras["valid"]
                scores += batch_scores[valid].tolist()
                lengths += rollout.response_mask.sum(1)[valid].tolist()
                ended += rollout.ended[valid].tolist()
        if not scores:
            raise UserError(f"evaluate: no reward source could score any of the {n} eval completions")
        return {
            "eval/scores": sum(scores) / len(scores),
            "eval/response_length": sum(lengths) / len(lengths),
            "eval/ended": sum(ended) / len(ended),
            "eval/num_scored": len(scores),
        }

    @torch.inference_mode()
    def sample_completions(self) -> list[dict]:
        """Completions for a few eval prompts (or the current batch), scored, as samples.jsonl rows
        (score None for a row no reward source could score under reward.on_error=skip)."""
        hp = self.config.ppo
        if self.eval_data is not None:
            n = min(hp.num_eval_samples, len(self.eval_data))
            prompts, columns = self.eval_data.rows(range(n))
            rollout = self.generate(self.eval_query_ids[:n])
            scores, extras = self.score(rollout, prompts, columns, update_statistics=False)
            completions, scores, split = extras["completions"], _scores_or_none(scores, extras["valid"]), "eval"
        else:
            prompts, completions, scores = (x[: hp.num_eval_samples] for x in self._last_batch)
            split = "train"
        return [
            {"update": self.update, "episode": self.episode, "split": split, "prompt": p, "completion": c, "score": s}
            for p, c, s in zip(prompts, completions, scores)
        ]

    def save_checkpoint(self) -> Path:
        """The whole training state in output_dir/checkpoints/update-N/ (see ppokit.checkpoint), once per update."""
        if self._saved_at is None or self._saved_at[0] != self.update:
            self._saved_at = (self.update, checkpoint.save_checkpoint(self))
        return self._saved_at[1]

    def save_final(self) -> Path:
        """policy + tokenizer in final/, the value model (with the tokenizer) in final/value_model/."""
        target = self.output_dir / "final"
        if self.accelerator.is_main_process:
            self.save_models(target)
        self.accelerator.wait_for_everyone()
        return target

    def save_models(self, target: Path, merged: bool = True) -> None:
        """Policy, tokenizer and value model as loadable folders; `merged`: also final/merged/ if configured."""

        def write(tmp: Path) -> None:
            merged_dir = tmp / "merged" if merged and self.config.save_merged else None
            roles.save_policy(self.policy, tmp, merged_dir)
            self.tokenizer.save_pretrained(tmp)
            if merged_dir is not None:
                self.tokenizer.save_pretrained(merged_dir)
            roles.save_value_model(self.value_model, tmp / "value_model")
            self.tokenizer.save_pretrained(tmp / "value_model")

        with _no_save_progress_bars():
            atomic_save_dir(target, write)


@contextlib.contextmanager
def _no_save_progress_bars():
    """A per-shard bar for every save would interleave with the run's own progress bar."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _lr_lambda(kind: str, warmup: int, total: int):
    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        return max(0.0, (total - step) / max(1, total - warmup)) if step >= warmup else 1.0

    return factor


def _fused_adamw_supported() -> bool:
    try:
        torch.optim.AdamW([nn.Parameter(torch.zeros(1))], fused=True)
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


def _scores_or_none(scores: torch.Tensor, valid: torch.Tensor) -> list[Optional[float]]:
    return [score if ok else None for score, ok in zip(scores.tolist(), valid.tolist())]


def _required(value, key: str):
    if value is None:
        raise UserError(f"{key}: required")
    return value


def _path_of(obj, fallback):
    if obj is not None and not isinstance(obj, str):
        path = getattr(getattr(obj, "config", None), "_name_or_path", None)
        if path and os.path.exists(path):
            return path
        raise UserError("pass `tokenizer=` (or `reward_tokenizer=`) when giving a model object without a saved path")
    return obj if obj is not None else fallback
