"""`ppokit sft`: supervised fine-tuning of a causal LM on prompt/completion or chat data.

data (any source, sft format) -> eval split -> render chats -> tokens under the length rule
-> `sft.train_sft` with eval loss -> model + tokenizer + config.yaml + metrics.jsonl in output_dir.
"""

from __future__ import annotations

import time

import torch

from ppokit.config import SFTConfig
from ppokit.data import LengthReport, Renderer, describe_template, fit_lengths, sft_pairs, tokenize_pair
from ppokit.metrics import JsonlWriter
from ppokit.models import resolve_model_path, load_causal_lm, load_tokenizer
from ppokit.sft import build_example, train_sft
from ppokit.stages.common import (
    device,
    load_split,
    printer,
    recorded_config,
    report_lengths,
    require_rows,
    write_output,
)


def encode_sft(pairs, renderer: Renderer, tokenizer, config: SFTConfig, source: str):
    """(prompt, completion) items -> ((input_ids, labels) examples, LengthReport)."""
    data = config.data
    examples, report = [], LengthReport(rows=len(pairs))
    for prompt, completion in pairs:
        prompt_text, completion_text = renderer.pair(prompt, completion, source)
        fitted, prompt_cut, completion_cut = fit_lengths(
            *tokenize_pair(tokenizer, prompt_text, completion_text), data.max_prompt_length, data.max_length
        )
        report.prompts_truncated += prompt_cut
        report.completions_cut += completion_cut
        if fitted is None:
            report.dropped += 1
            continue
        examples.append(build_example(*fitted, config.train.completion_only_loss))
    return examples, report


def run_sft(config: SFTConfig, show_progress: bool = True) -> dict:
    """Train, evaluate and save; returns the summary (also written to output_dir/summary.json)."""
    start = time.perf_counter()
    config.validate()
    say = printer(show_progress, "sft")
    hp, data = config.train, config.data
    train_pairs, eval_pairs, records = load_split(data, config.seed, sft_pairs, say)

    resolve_model_path(config.model, "model")  # a missing path is named as the model, not the tokenizer
    tokenizer = load_tokenizer(config.tokenizer or config.model, config.trust_remote_code)
    renderer = Renderer(tokenizer, data.chat_template)
    train_examples, train_report = encode_sft(train_pairs, renderer, tokenizer, config, records.source)
    eval_examples, eval_report = encode_sft(eval_pairs, renderer, tokenizer, config, records.source)
    report_lengths(say, train_report, data, "train")
    report_lengths(say, eval_report, data, "eval")
    require_rows(train_examples, train_report, data, records.source, "training")
    if renderer.template_used is not None:
        say(f"chat rows rendered with {describe_template(renderer.template_used)}")

    torch.manual_seed(config.seed)
    model = load_causal_lm(config.model, "model", config.trust_remote_code).to(device())

    def write(tmp) -> dict:
        metrics = JsonlWriter(tmp / "metrics.jsonl")
        evals: list[dict] = []

        def on_step(step, total, loss):
            metrics.write({"step": step, "loss": loss})
            if step % hp.logging_steps == 0 or step == total:
                say(f"step {step}/{total} | loss {loss:.4f}")

        def on_eval(step, result):
            evals.append({"step": step, **result})
            metrics.write(evals[-1])
            say(f"step {step} | eval loss {result['eval_loss']:.4f}")

        try:
            losses = train_sft(
                model, train_examples, tokenizer.pad_token_id, epochs=hp.num_train_epochs,
                batch_size=hp.per_device_train_batch_size, learning_rate=hp.learning_rate, seed=config.seed,
                on_step=on_step, eval_examples=eval_examples or None, eval_every=hp.eval_steps,
                eval_batch_size=hp.eval_batch_size, on_eval=on_eval, weight_decay=hp.weight_decay,
                max_grad_norm=hp.max_grad_norm,
            )
        finally:
            metrics.close()
        if renderer.template_used is not None:
            tokenizer.chat_template = renderer.template_used  # PPO and rm render chats the same way
        model.config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tail = losses[-10:]
        return {
            "stage": "sft",
            "output_dir": config.output_dir,
            "format": records.format,
            "train_rows": len(train_examples),
            "eval_rows": len(eval_examples),
            "steps": len(losses),
            "first_loss": losses[0],
            "last_loss": sum(tail) / len(tail),
            "eval_loss": evals[-1]["eval_loss"] if evals else None,
            "length_rule": {"train": vars(train_report), "eval": vars(eval_report)},
            "chat_template": renderer.template_used,
            "seconds": round(time.perf_counter() - start, 1),
        }

    summary = write_output(config.output_dir, write, lambda: recorded_config(config, renderer.template_used))
    say(f"saved to {config.output_dir} (use it as ppo `model` and rm `model`)")
    return summary
