"""A reward model (one-label sequence classifier) as a reward source, whatever its tokenizer."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional

import torch

from ppokit.training import batching
from ppokit.errors import UserError
from ppokit.models.forwards import check_packed_forward, left_pad, score_at_last_token
from ppokit.models.loading import input_pad_id, load_scalar_model, load_tokenizer, position_limit, same_vocabulary
from ppokit.rewards.sources import ScoringBatch


def load_reward_model(name_or_model, trust_remote_code: bool = False, **load_kwargs):
    """A frozen one-label classifier with a trained head; anything else is a UserError before training."""
    model = load_scalar_model(name_or_model, "reward.model", trust_remote_code, require_trained_head=True, **load_kwargs)
    return model.requires_grad_(False).eval()


@dataclass
class RewardModelReward:
    """Scores prompt + completion at the last real token (never at padding, on either side).

    Same vocabulary as the policy: the policy's token ids are scored as they are, no round trip.
    Otherwise each row is decoded with the policy's tokenizer and encoded with the reward model's
    own: through its chat template when the rows carry a `messages` column (the prompt as chat
    messages), else as plain text followed by its EOS token when the response stopped, so it sees
    the same shape of sequence as in the shared-vocabulary case.
    """

    model: torch.nn.Module
    tokenizer: Any
    name: str = "reward_model"
    batch_size: int = 64
    # With ppo.max_tokens_per_micro_batch: chunks by tokens (rows of similar length together, each
    # chunk within batch_size rows of the batch's full width, right-aligned to its own longest row) instead of rows.
    by_tokens: bool = False
    # ppo.padding_free: the forwards over packed rows (`models.packing`), the token budget filling them.
    padding_free: bool = False
    # What the model is scored under: with the critic's LoRA adapter on the reward model's own weights, that adapter
    # disabled (`roles.build_roles`: `adapters.adapters_disabled`).
    scored_under: Callable[[], ContextManager] = contextlib.nullcontext
    _shared: dict = field(default_factory=dict, repr=False)  # id(policy tokenizer) -> same vocabulary?

    def score(self, batch: ScoringBatch) -> torch.Tensor:
        with self.scored_under():
            return self._score(batch)

    @torch.inference_mode()
    def _score(self, batch: ScoringBatch) -> torch.Tensor:
        device = next(self.model.parameters()).device
        if batch.input_ids is not None and self.shares_vocabulary(batch.tokenizer):
            ids, mask = batch.input_ids, batch.attention_mask
        else:
            ids, mask = left_pad(self.encode(batch), input_pad_id(self.tokenizer, [self.model.config]))
        if not self.by_tokens:
            scores = [
                score_at_last_token(self.model, ids[i : i + self.batch_size].to(device), mask[i : i + self.batch_size].to(device),
                                    self.padding_free)
                for i in range(0, ids.shape[0], self.batch_size)
            ]
            return torch.cat(scores).float().cpu()
        plan_chunks = batching.plan_packed_micro_batches if self.padding_free else batching.plan_micro_batches
        plan = plan_chunks(torch.arange(ids.shape[0]), mask.sum(1), self.batch_size * ids.shape[1])
        pieces = []
        for index in plan:
            chunk_ids, chunk_mask, _ = batching.right_align(ids[index], mask[index])
            chunk_scores = score_at_last_token(self.model, chunk_ids.to(device), chunk_mask.to(device), self.padding_free)
            pieces.append((index, chunk_scores.float().cpu().unsqueeze(1)))
        return batching.restore(pieces, ids.shape[0], 1).squeeze(1)

    def shares_vocabulary(self, policy_tokenizer) -> bool:
        if policy_tokenizer is None:
            return False
        key = id(policy_tokenizer)
        if key not in self._shared:
            self._shared[key] = same_vocabulary(self.tokenizer, policy_tokenizer)
        return self._shared[key]

    def encode(self, batch: ScoringBatch) -> list[list[int]]:
        """Rows in the reward model's tokens (batched through its fast tokenizer), cut from the left to fit."""
        messages = chat_messages(batch)
        if messages is not None and getattr(self.tokenizer, "chat_template", None):
            chats = [m + [{"role": "assistant", "content": c}] for m, c in zip(messages, batch.completions)]
            texts = [self.tokenizer.apply_chat_template(chat, tokenize=False) for chat in chats]
            encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        else:
            encoded = self.tokenizer(full_texts(batch), add_special_tokens=True)["input_ids"]
            eos = self.tokenizer.eos_token_id
            if batch.ended is not None and eos is not None:
                encoded = [
                    ids + [eos] if stopped and (not ids or ids[-1] != eos) else ids
                    for ids, stopped in zip(encoded, batch.ended.tolist())
                ]
        limit = position_limit(self.model, "reward.model")
        return [ids[-limit.tokens :] if limit and len(ids) > limit.tokens else ids for ids in encoded]


def full_texts(batch: ScoringBatch) -> list[str]:
    """Prompt + completion as text. From the policy's ids when there are some: decoding the whole
    sequence keeps the space between prompt and completion that decoding them apart can drop."""
    if batch.input_ids is None or batch.tokenizer is None:
        return [p + c for p, c in zip(batch.prompts, batch.completions)]
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(batch.input_ids.cpu(), batch.attention_mask.cpu())]
    return batch.tokenizer.batch_decode(rows, skip_special_tokens=True)


def chat_messages(batch: ScoringBatch) -> Optional[list[list[dict]]]:
    """The prompt turns of the `messages` column when every row holds a list of {role, content}
    dicts, else None. A final assistant turn is the data's reference answer, not the prompt: it is
    left out, as it was when the policy's prompt was made from the same row."""
    column = batch.columns.get("messages")
    if column is None:
        return None
    for row in column:
        if not isinstance(row, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in row):
            return None
    return [list(row[:-1]) if row and row[-1]["role"] == "assistant" else list(row) for row in column]


def reward_model_source(name_or_model, tokenizer=None, batch_size: int = 64, trust_remote_code: bool = False, by_tokens: bool = False,
                        padding_free: bool = False, **load_kwargs) -> RewardModelReward:
    """A path (its saved tokenizer is used) or a model object with its tokenizer -> a source.
    by_tokens: score in token-budget chunks (`RewardModelReward.by_tokens`); padding_free: over packed rows (checked
    here to keep them apart: `check_packed_forward`).
    `load_kwargs` go to from_pretrained (e.g. a quantisation config)."""
    model = load_reward_model(name_or_model, trust_remote_code, **load_kwargs)
    if tokenizer is None:
        path = name_or_model if isinstance(name_or_model, str) else getattr(model.config, "_name_or_path", None)
        if not path:
            raise UserError("reward model given as an object: pass its tokenizer too (`reward_tokenizer=`)")
        tokenizer = load_tokenizer(path, trust_remote_code)
    if padding_free:
        check_packed_forward(model, "ppo.padding_free")
    return RewardModelReward(model, tokenizer, batch_size=batch_size, by_tokens=by_tokens, padding_free=padding_free)
