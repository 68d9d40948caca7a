"""`ppokit sft`: supervised fine-tuning of a causal LM on prompt/completion or chat data.

data (any source, sft format) -> eval split -> render chats -> tokens under the length rule
-> `sft.train_sft` with eval loss -> model + tokenizer + config.yaml + metrics.jsonl in output_dir.
"""

from __future__ import annotations

import torch

from ppokit.config.stages import SFTConfig
from ppokit.data.formats import sft_pairs
from ppokit.models.loading import input_pad_id, load_causal_lm
from ppokit.training.sft import build_example, train_sft
from ppokit.stages.common import StepLog, device, prepare_data, run_stage, save_model_and_tokenizer, save_stage


def run_sft(config: SFTConfig, show_progress: bool = True, overwrite: bool = False) -> dict:
    """Train, evaluate and save; returns the summary (also written to output_dir/summary.json).
    An existing output_dir that is not a ppokit output is replaced only with `overwrite`."""
    return run_stage("sft", config, _train_and_save, show_progress, overwrite)


def _train_and_save(config: SFTConfig, say, overwrite: bool, start: float) -> dict:
    hp = config.train
    prepared = prepare_data(
        config, say, sft_pairs, lambda row: build_example(*row.fitted[0], config.train.completion_only_loss)
    )
    tokenizer, train_examples, eval_examples = prepared.tokenizer, prepared.train, prepared.eval

    torch.manual_seed(config.seed)
    model = load_causal_lm(config.model, "model", config.trust_remote_code).to(device())

    def write(tmp) -> dict:
        log = StepLog(tmp / "metrics.jsonl", say, hp.logging_steps, lambda r: f"eval loss {r['eval_loss']:.4f}")
        try:
            losses = train_sft(
                model, train_examples, input_pad_id(tokenizer, [model.config]), epochs=hp.num_train_epochs,
                batch_size=hp.per_device_train_batch_size, learning_rate=hp.learning_rate, seed=config.seed,
                on_step=log.on_step, eval_examples=eval_examples or None, eval_every=hp.eval_steps,
                eval_batch_size=hp.eval_batch_size, on_eval=log.on_eval, weight_decay=hp.weight_decay,
                max_grad_norm=hp.max_grad_norm,
            )
        finally:
            log.close()
        save_model_and_tokenizer(model, tokenizer, prepared.renderer, tmp)
        evals = {"eval_loss": log.evals[-1]["eval_loss"] if log.evals else None}
        return prepared.summary("sft", config.output_dir, "rows", losses, evals, start)

    return save_stage(config, "sft", write, prepared, overwrite, say, "ppo `model` and rm `model`")
