"""Evaluation: completions sampled with the current policy and scored, without training and without moving the
reward normalisation. `evaluate` gives the eval metrics over the eval prompts; `sample_rows` the rows of
samples.jsonl (a few eval prompts, else the last update's batch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from ppokit.errors import UserError
from ppokit.metrics.values import eval_metrics, pass_at_k_metrics
from ppokit.training.episodes import repeat_each
from ppokit.training.rollout import Rollout


@dataclass(frozen=True)
class EvalSamples:
    """How each eval prompt is sampled and judged (ppo.eval_samples_per_prompt, eval_pass_at_k, eval_correct_threshold)."""

    per_prompt: int = 1
    pass_at_k: list[int] = field(default_factory=list)
    threshold: float = 1.0

    @classmethod
    def of(cls, hp) -> "EvalSamples":
        """The run's, from its `ppo:` section."""
        return cls(hp.eval_samples_per_prompt, list(hp.eval_pass_at_k), hp.eval_correct_threshold)

    def rows(self, prompts: range) -> list[int]:
        """The data rows to sample: each prompt of `prompts` `per_prompt` times, adjacent."""
        return repeat_each(list(prompts), self.per_prompt)

    def metrics(self, scores: list[Optional[float]]) -> dict[str, float]:
        """pass@k and mean@n over `scores`, per_prompt adjacent entries per prompt (None: unscored); {} without ks."""
        return pass_at_k_metrics(scores, self.per_prompt, self.pass_at_k, self.threshold)


@torch.inference_mode()
def evaluate(rollout: Rollout, data, query_ids: Optional[list[list[int]]], *, max_prompts: Optional[int], seed: int,
             rows_per_call: int, device: torch.device, samples: EvalSamples = EvalSamples()) -> dict[str, float]:
    """`eval/scores`, `eval/response_length`, `eval/ended` and `eval/num_scored` over the prompts of `data` (all of them,
    or the first `max_prompts`; query_ids: their token ids), each sampled `samples.per_prompt` times, with
    `eval/pass@k` and `eval/mean@n` when `samples` asks for them; sampled about `rows_per_call` rows at a time (whole
    prompts) for `eval` (ppo.eval_temperature) with torch's generator seeded with `seed` and given back as it was
    (training's random stream is left as it was; `device`'s too, on CUDA)."""
    if data is None:
        raise UserError("evaluate: no eval prompts; set data.eval or data.eval_fraction, or pass eval_dataset=")
    n = len(data) if max_prompts is None else min(max_prompts, len(data))
    prompts_per_call = max(1, rows_per_call // samples.per_prompt)
    every, scores, lengths, ended = [], [], [], []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for start in range(0, n, prompts_per_call):
            rows = samples.rows(range(start, min(n, start + prompts_per_call)))
            episodes, scored = rollout.sample_and_score(data, query_ids, rows, "eval")
            valid = scored.valid
            every += scores_or_none(scored.scores, valid)
            scores += scored.scores[valid].tolist()
            lengths += episodes.loss_mask.sum(1)[valid].tolist()
            ended += episodes.ended[valid].tolist()
    if not scores:
        raise UserError(f"evaluate: no reward source could score any of the {n * samples.per_prompt} eval completions")
    return {**eval_metrics(scores, lengths, ended), **samples.metrics(every)}


@torch.inference_mode()
def sample_rows(rollout: Rollout, data, query_ids: Optional[list[list[int]]], n: int, last_batch: list[dict],
                samples: EvalSamples = EvalSamples(), **row) -> list[dict]:
    """samples.jsonl rows: completions for the first `n` prompts of `data` (the eval prompts; query_ids their token ids),
    each sampled `samples.per_prompt` times (adjacent rows), scored, or without them the first `n` of `last_batch` (the
    last update's `scored_rows`); each row with `row`'s fields (update, episode) first; sampled with the seeds of `row`'s update."""
    if data is not None:
        rows = samples.rows(range(min(n, len(data))))
        episodes, scored = rollout.sample_and_score(data, query_ids, rows, "eval", row.get("update"))
        prompts, columns = data.rows(rows)
        rows, split = scored_rows(prompts, columns, scored, episodes, scored.valid), "eval"
    else:
        rows, split = last_batch[:n], "train"
    return [{**row, "split": split, **scored_row} for scored_row in rows]


def scored_rows(prompts: list[str], columns: dict[str, list], scored, episodes, valid: torch.Tensor) -> list[dict]:
    """One samples.jsonl row per episode (without update, episode and split): its prompt and completion, its score (None
    where `valid` is false: no reward source could score it), each reward source's raw score as `rewards` ({name: score},
    before weights and normalisation, as `reward/<name>`; None where that source gave none), the data columns the
    sources and the environment were given (`columns`), and with an environment its turns (`sample_row`)."""
    scores, turns = scores_or_none(scored.scores, valid), transcripts(episodes)
    sources = {name: [None if math.isnan(v) else v for v in values.tolist()] for name, values in scored.sources.items()}
    return [sample_row({"prompt": prompt, "completion": completion, "score": score,
                        "rewards": {name: values[i] for name, values in sources.items()},
                        "columns": {name: values[i] for name, values in columns.items()}}, turns[i])
            for i, (prompt, completion, score) in enumerate(zip(prompts, scored.completions, scores))]


def eval_score(rows: list[dict], samples: EvalSamples = EvalSamples()) -> dict[str, float]:
    """{"eval/scores": the mean score of the scored eval rows among `rows`} with pass@k and mean@n as `samples` asks
    (the rows of `sample_rows`: `samples.per_prompt` adjacent rows per prompt), or {} (none scored; training-batch rows)."""
    evals = [r["score"] for r in rows if r["split"] == "eval"]
    scored = [score for score in evals if score is not None]
    return {"eval/scores": sum(scored) / len(scored), **samples.metrics(evals)} if scored else {}


def transcripts(episodes) -> list[Optional[list[dict]]]:
    """Each episode's turns (`Episodes.transcripts`), the `turns` of its samples.jsonl row; None per row without an environment."""
    return [None] * len(episodes) if episodes.transcripts is None else list(episodes.transcripts)


def scores_or_none(scores: torch.Tensor, valid: torch.Tensor) -> list[Optional[float]]:
    return [score if ok else None for score, ok in zip(scores.tolist(), valid.tolist())]


def sample_row(row: dict, turns: Optional[list[dict]]) -> dict:
    """A samples.jsonl row with its episode's turns marked (`turns`), unchanged for a single-turn response."""
    return row if turns is None else {**row, "turns": turns}
