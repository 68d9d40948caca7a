"""What the sft and rm stages share: data with its eval split, progress lines, the output folder."""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ppokit.conversation.templates import Renderer, describe_template
from ppokit.config.stages import StageDataConfig
from ppokit.data.formats import Records, load_records, split_eval
from ppokit.errors import UserError
from ppokit.data.lengths import EncodedRow, LengthReport, encode_rows
from ppokit.metrics.sinks import JsonlWriter
from ppokit.run.model_card import stage_card
from ppokit.models.loading import PositionLimit, check_token_ids, load_tokenizer, model_config, no_progress_bars, position_limit, resolve_model_path
from ppokit.run.run_dir import NoSpaceError, atomic_save_dir, check_output_dir, check_replaceable, locked_output, remove_leftovers


def printer(enabled: bool, stage: str) -> Callable[[str], None]:
    """Progress lines on stderr, prefixed with the stage name (stdout is left for the summary)."""
    if not enabled:
        return lambda text: None
    return lambda text: print(f"{stage}: {text}", file=sys.stderr, flush=True)


def load_split(data: StageDataConfig, seed: int, convert: Callable[[Records], list], say) -> tuple[list, list, Records]:
    """Train items, eval items (from data.eval, else a seeded data.eval_fraction split), train Records.

    `convert` turns Records into the stage's items, one per row, and raises when the format is the
    wrong one, so that a wrong file fails before any model is loaded. Each item comes as
    (where its row is, item), for messages about the row.
    """
    records = load_records(data.train, data.format)
    items = located(records, convert)
    say(f"{records.source}: {len(records)} rows, format {records.describe()}")
    if data.eval:
        eval_records = load_records(data.eval, data.format)
        held = located(eval_records, convert)
        say(f"{eval_records.source}: {len(eval_records)} eval rows, format {eval_records.describe()}")
    else:
        items, held = split_eval(items, data.eval_fraction, seed)
        if held:
            say(f"held out {len(held)} of {len(records)} rows for evaluation (data.eval_fraction={data.eval_fraction}, seed {seed})")
    return items, held, records


def located(records: Records, convert: Callable[[Records], list]) -> list[tuple[str, Any]]:
    return [(records.where(i), item) for i, item in enumerate(convert(records))]


def require_rows(examples: list, report: LengthReport, data: StageDataConfig, source: str, split: str) -> None:
    if not examples:
        fix = ("raise data.max_length / data.max_prompt_length or shorten the prompts"
               if report.identical_pairs < report.dropped else "give pairs whose chosen and rejected completions differ")
        raise UserError(f"{source}: no {split} rows left after the length rule ({report.describe(data.max_prompt_length, data.max_length)}); {fix}")


def report_lengths(say, report: LengthReport, data: StageDataConfig, split: str) -> None:
    if report.prompts_truncated or report.completions_cut or report.dropped:
        say(f"{split}: {report.describe(data.max_prompt_length, data.max_length)}")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def recorded_config(config, template_used):
    """The config as it ran: data.chat_template set to the template used for chat rows."""
    recorded = copy.deepcopy(config)
    if template_used is not None:
        recorded.data.chat_template = template_used
    return recorded


@contextlib.contextmanager
def claimed_output(output_dir: str, overwrite: bool, say) -> Iterator[None]:
    """For the whole stage, from before any model loads: output_dir is usable and may be replaced (ppokit's
    own output, or --overwrite), is this run's alone (`run_dir.locked_output`: a second run into it is
    refused), and what an earlier run of this stage left there when it was killed is cleared."""
    path = check_output_dir(output_dir)
    check_replaceable(path, overwrite)
    with locked_output(path):
        for done in remove_leftovers(path.parent, path.name):
            say(done)
        yield


def run_stage(stage: str, config, train_and_save: Callable[..., dict], show_progress: bool, overwrite: bool) -> dict:
    """A stage from its config to its summary: the config checked, output_dir claimed for the whole stage
    (`claimed_output`), then train_and_save(config, say, overwrite, start) -> the summary."""
    start = time.perf_counter()
    config.validate()
    say = printer(show_progress, stage)
    with claimed_output(config.output_dir, overwrite, say):
        return train_and_save(config, say, overwrite, start)


def write_output(output_dir: str, write: Callable[[Path], dict], config_of_run, stage: str, overwrite: bool = False) -> dict:
    """Run `write(tmp)` (trains and saves into tmp, returns the summary), add config.yaml and
    summary.json, and rename tmp to output_dir: an interrupted stage leaves no finished-looking output."""
    summary: dict = {}

    def complete(tmp: Path) -> None:
        summary.update(write(tmp))
        config_of_run().save(tmp / "config.yaml")
        (tmp / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        stage_card(stage, config_of_run(), summary).write(tmp)

    try:
        atomic_save_dir(Path(output_dir), complete, stage, replace_unmarked=overwrite)
    except NoSpaceError as e:
        raise UserError(f"{e}; the partial output was removed and {output_dir} is as it was before this run") from None
    return summary


def save_stage(config, stage: str, write: Callable[[Path], dict], prepared: "PreparedData", overwrite: bool, say, use: str) -> dict:
    """`write_output` with the run's config as recorded (its chat template included); says where to use the output."""
    summary = write_output(config.output_dir, write, lambda: recorded_config(config, prepared.renderer.template_used), stage, overwrite)
    say(f"saved to {config.output_dir} (use it as {use})")
    return summary


@dataclass
class PreparedData:
    """A stage's tokenizer, chat renderer and encoded train/eval rows, with the length-rule reports."""

    tokenizer: Any
    renderer: Renderer
    records: Records
    train: list
    eval: list
    train_report: LengthReport
    eval_report: LengthReport

    def summary(self, stage: str, output_dir: str, unit: str, losses: list[float], evals: dict, start: float) -> dict:
        """A stage's summary.json: what it trained on (`unit`: rows or pairs), its losses, its own evaluation
        entries `evals`, the length rule's counts, the chat template used and the seconds since `start`."""
        tail = losses[-10:]
        return {
            "stage": stage,
            "output_dir": output_dir,
            "format": self.records.format,
            f"train_{unit}": len(self.train),
            f"eval_{unit}": len(self.eval),
            "steps": len(losses),
            "first_loss": losses[0],
            "last_loss": sum(tail) / len(tail),
            **evals,
            "length_rule": {"train": vars(self.train_report), "eval": vars(self.eval_report)},
            "chat_template": self.renderer.template_used,
            "seconds": round(time.perf_counter() - start, 1),
        }


def prepare_data(config, say, convert: Callable[[Records], list], build: Callable[[EncodedRow], Any]) -> PreparedData:
    """Load and split `config.data`, load the tokenizer, encode both splits under the length rule
    (`data.encode_rows`, as `data inspect` does), report and check them, and turn each kept row
    into what the stage trains on with `build(row)`."""
    data = config.data
    train_items, eval_items, records = load_split(data, config.seed, convert, say)
    resolve_model_path(config.model, "model")  # a missing path is named as the model, not the tokenizer
    tokenizer = load_tokenizer(config.tokenizer or config.model, config.trust_remote_code)
    renderer = Renderer(tokenizer, data.chat_template)
    train, train_report = encode_rows(train_items, renderer, tokenizer, data.max_prompt_length, data.max_length)
    evaluation, eval_report = encode_rows(eval_items, renderer, tokenizer, data.max_prompt_length, data.max_length)
    report_lengths(say, train_report, data, "train")
    report_lengths(say, eval_report, data, "eval")
    require_rows(train, train_report, data, records.source, "training")
    check_fits_model(config, train + evaluation, tokenizer)
    if renderer.template_used is not None:
        say(f"chat rows rendered with {describe_template(renderer.template_used)}")
    return PreparedData(
        tokenizer, renderer, records, [build(r) for r in train], [build(r) for r in evaluation], train_report, eval_report
    )


def check_fits_model(config, rows: list[EncodedRow], tokenizer) -> None:
    """Every kept sequence fits the model's positions, and every token id its embeddings (read from
    its config.json, before any weights load)."""
    model = model_config(config.model, "model", config.trust_remote_code)
    check_token_ids(model, "model", ((row.where, s) for row in rows for s in row.sequences), tokenizer)
    limit = position_limit(model, "model")
    if limit is not None:
        limit.check(
            ((row.where, max(len(s) for s in row.sequences)) for row in rows),
            lambda n: f"prompt + completion is {n} tokens after the length rule",
            max_length_room(limit),
        )


def max_length_room(limit: PositionLimit) -> str:
    """How to make sft/rm sequences fit `limit`."""
    return f"set data.max_length to at most {limit.tokens}"


class StepLog:
    """metrics.jsonl of a supervised stage (a record per step and per evaluation) and its console lines."""

    def __init__(self, path: Path, say, logging_steps: int, describe_eval: Callable[[dict], str]):
        self.metrics = JsonlWriter(path)
        self.evals: list[dict] = []
        self.say, self.logging_steps, self.describe_eval = say, logging_steps, describe_eval

    def on_step(self, step: int, total: int, loss: float) -> None:
        self.metrics.write({"step": step, "loss": loss})
        if step % self.logging_steps == 0 or step == total:
            self.say(f"step {step}/{total} | loss {loss:.4f}")

    def on_eval(self, step: int, result: dict) -> None:
        self.evals.append({"step": step, **result})
        self.metrics.write(self.evals[-1])
        self.say(f"step {step} | {self.describe_eval(result)}")

    def close(self) -> None:
        self.metrics.close()


def save_model_and_tokenizer(model, tokenizer, renderer: Renderer, directory: Path) -> None:
    """The model and its tokenizer, the tokenizer carrying the chat template the rows were rendered
    with, so that later stages render chats the same way."""
    if renderer.template_used is not None:
        tokenizer.chat_template = renderer.template_used
    model.config.pad_token_id = tokenizer.pad_token_id
    with no_progress_bars():
        model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)

