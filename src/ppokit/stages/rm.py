"""`ppokit rm`: a reward model trained on preference pairs with the Bradley-Terry loss.

The model is a one-label `AutoModelForSequenceClassification`, by default built on the SFT
model's backbone (a fresh score head). Each sequence is prompt + completion + EOS and is scored
at its last real token (`models.score_at_last_token`), as PPO will score the policy's responses.
The output folder is what `ppokit ppo` takes as `reward.model` and as `value_model`.
"""

from __future__ import annotations

import torch

from ppokit.training.losses import bradley_terry_loss
from ppokit.config.stages import RMConfig
from ppokit.data.formats import preference_triples
from ppokit.models.forwards import left_pad, score_at_last_token
from ppokit.models.loading import disable_dropout, input_pad_id, load_scalar_model
from ppokit.training.sft import train_loop
from ppokit.stages.common import StepLog, device, prepare_data, run_stage, save_model_and_tokenizer, save_stage


def pair_scores(model, pairs, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of the chosen and the rejected sequence of each pair, in one forward: -> ((B,), (B,))."""
    ids, mask = left_pad([c for c, _ in pairs] + [r for _, r in pairs], pad_token_id, next(model.parameters()).device)
    scores = score_at_last_token(model, ids, mask.long())
    return scores[: len(pairs)], scores[len(pairs) :]


@torch.no_grad()
def evaluate_pairs(model, pairs, pad_token_id: int, batch_size: int) -> dict:
    """Pairwise accuracy (chosen scored strictly higher), mean margin and loss over `pairs`."""
    model.eval()
    chosen, rejected = [], []
    for i in range(0, len(pairs), batch_size):
        c, r = pair_scores(model, pairs[i : i + batch_size], pad_token_id)
        chosen.append(c)
        rejected.append(r)
    chosen, rejected = torch.cat(chosen), torch.cat(rejected)
    return {
        "eval_accuracy": (chosen > rejected).float().mean().item(),
        "eval_margin": (chosen - rejected).mean().item(),
        "eval_loss": bradley_terry_loss(chosen, rejected).item(),
        "eval_chosen_score": chosen.mean().item(),
        "eval_rejected_score": rejected.mean().item(),
    }


def run_rm(config: RMConfig, show_progress: bool = True, overwrite: bool = False) -> dict:
    """Train, evaluate and save; returns the summary (also written to output_dir/summary.json).
    An existing output_dir that is not a ppokit output is replaced only with `overwrite`."""
    return run_stage("rm", config, _train_and_save, show_progress, overwrite)


def _train_and_save(config: RMConfig, say, overwrite: bool, start: float) -> dict:
    hp = config.train
    # Each kept row: (chosen ids, rejected ids), prompt included; the length rule drops a pair
    # that either sequence leaves no room for, or that cutting made identical.
    prepared = prepare_data(config, say, preference_triples, lambda row: tuple(row.sequences))
    tokenizer, train_pairs, eval_pairs = prepared.tokenizer, prepared.train, prepared.eval

    torch.manual_seed(config.seed)
    model = load_scalar_model(config.model, "model", config.trust_remote_code)
    model.config.pad_token_id = tokenizer.pad_token_id
    disable_dropout(model)
    model.to(device())
    pad = input_pad_id(tokenizer, [model.config])
    evaluate = (lambda: evaluate_pairs(model, eval_pairs, pad, hp.eval_batch_size)) if eval_pairs else None
    before = evaluate() if evaluate else {}
    if before:
        say(f"before training | eval accuracy {before['eval_accuracy']:.3f} | margin {before['eval_margin']:+.3f}")

    def loss_fn(model, batch):
        return bradley_terry_loss(*pair_scores(model, batch, pad))

    def write(tmp) -> dict:
        log = StepLog(
            tmp / "metrics.jsonl", say, hp.logging_steps,
            lambda r: f"eval accuracy {r['eval_accuracy']:.3f} | margin {r['eval_margin']:+.3f} | loss {r['eval_loss']:.4f}",
        )
        try:
            losses = train_loop(
                model, train_pairs, loss_fn, epochs=hp.num_train_epochs, batch_size=hp.per_device_train_batch_size,
                learning_rate=hp.learning_rate, weight_decay=hp.weight_decay, max_grad_norm=hp.max_grad_norm,
                seed=config.seed, on_step=log.on_step, evaluate=evaluate, eval_every=hp.eval_steps, on_eval=log.on_eval,
            )
        finally:
            log.close()
        save_model_and_tokenizer(model, tokenizer, prepared.renderer, tmp)
        last = log.evals[-1] if log.evals else {}
        evals = {
            "eval_accuracy_before": before.get("eval_accuracy"),
            "eval_accuracy": last.get("eval_accuracy"),
            "eval_margin": last.get("eval_margin"),
            "eval_loss": last.get("eval_loss"),
        }
        return prepared.summary("rm", config.output_dir, "pairs", losses, evals, start)

    return save_stage(config, "rm", write, prepared, overwrite, say, "ppo `reward.model` and `value_model`")
