"""`ppokit` command line: parse, call, print. User errors exit 2 with one line, no traceback."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import warnings
from typing import Iterator, NoReturn, Optional, TextIO

from ppokit.process import cpu_threads, interrupts
from ppokit.errors import TrainingInterrupted, UserError
from ppokit.version import __version__


def _ppo(args) -> int:
    from ppokit.process import launcher
    from ppokit.run import run_dir
    from ppokit.config.schema import PPOConfig
    from ppokit.training.startup import check_config

    launcher.check_launch()  # a launch that cannot run as asked stops first, before the config is even read
    overrides, resume = list(args.overrides), args.resume
    if args.resume_force and resume is None:
        raise UserError("--resume-force only applies with --resume")
    config = PPOConfig.load(args.config, overrides)
    check_config(config)  # `ppokit plan` runs it too; the rest of the start-up checks are the trainer's (`startup.prepare`)
    _start_again_with(config.cpu_allocator)  # before the run folder's lock and any weights
    # Before any weights load: the run folder may be used (not another tool's), is this run's alone (the
    # lock, held until the command ends: a run in progress is named by its PID), holds no run that a fresh
    # start would replace, and the checkpoint to resume is found and read whole.
    if resume is not None and args.overwrite:
        raise UserError("--resume continues the run in output_dir and --overwrite replaces it: give one of them")
    run = run_dir.RunFolder.open(config.output_dir, main_process=_is_main_process(), overwrite=args.overwrite)
    try:
        from ppokit.run import checkpoint  # torch: only once the config and the run folder are known to be good

        run_dir.check_run_start(config.output_dir, resume=resume is not None, overwrite=args.overwrite)
        for note in run.notes:
            print(f"ppokit: {note}", file=sys.stderr)
        say = (lambda message: print(f"ppokit: {message}", file=sys.stderr)) if _is_main_process() else None
        resume_path = checkpoint.find_checkpoint(None if resume == "latest" else resume, config.output_dir, say) if resume is not None else None
        if resume_path is not None:
            resume_path = resume_path.absolute()  # user code may change the working directory before it is read
            run_dir.check_resume_into(config.output_dir, resume_path)
            checkpoint.read_checkpoint(resume_path)  # a damaged file is found before any model loads
        # Once, absolutely (checked and named as given until here): user code, imported from the plan on, may change
        # the working directory.
        config.output_dir = str(run.root)
        return _train(args, config, overrides, resume_path)
    finally:
        run.close()


def _train(args, config, overrides: list[str], resume_path) -> int:
    from ppokit.trainer import PPOTrainer

    if _is_main_process():
        _preflight(config, args.ignore_plan, args.overwrite)
    trainer = PPOTrainer(config, overwrite=args.overwrite)
    if resume_path is not None:
        trainer.resume_from(resume_path, force=args.resume_force)
        print(f"ppokit: resumed from {resume_path} (update {trainer.state.update} of {trainer.sizes.num_updates})", file=sys.stderr)
        if trainer.state.update >= trainer.sizes.num_updates:
            print("ppokit: that checkpoint is the end of the run; nothing left to train", file=sys.stderr)
    try:
        records = trainer.train()
    except TrainingInterrupted as e:
        return _stopped(e, "resume with: " + shlex.join(["ppokit", "ppo", args.config, *overrides, "--resume"]))
    scores = [r["objective/scores"] for r in records if "objective/scores" in r]
    if _is_main_process():
        result(json.dumps({"output_dir": config.output_dir, "updates": len(records), "final_score": scores[-1] if scores else None}))
    return 0


def _is_main_process() -> bool:
    from ppokit.process.launcher import launched_rank

    # Read from the launcher's environment: the Accelerator does not exist yet when the plan prints.
    return launched_rank() == 0


PLAN_DOES_NOT_FIT = 3


class PlanDoesNotFit(UserError):
    """The plan estimates that the run does not fit the device: the run stops before any weights load."""

    exit_code = PLAN_DOES_NOT_FIT


def _preflight(config, ignore_plan: bool = False, overwrite: bool = False) -> None:
    """The plan before any weights load. A run it estimates not to fit stops here, unless `ignore_plan`
    (a run that cannot fit would fail later, after loading every model, or exhaust the machine's
    memory); a plan that cannot be made never stops a run (config mistakes are the config's), nor does one
    whose config the run refuses at start-up (`startup.prepare`: the trainer says that first, as `ppokit plan` does)."""
    from ppokit.plan import plan_for

    try:
        # The start-up checks are the trainer's, next (here as well, the user's reward files would be imported twice):
        # only a plan that would stop the run asks them first.
        plan = plan_for(config, startup_checks=False)
        if not plan.fits and not ignore_plan:
            plan = plan_for(config, overwrite=overwrite)
    except UserError:
        return  # the same mistake stops the trainer next, with one line; the plan adds nothing to it
    except Exception as e:  # an estimate must never stop a run that might fit
        print(f"plan: skipped ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", file=sys.stderr)
        return
    if plan.stops:
        return  # the trainer stops on it before any weights load, with its own one line
    if not plan.fits and not ignore_plan:
        ways = [w for w in (plan.sharding_suggestion, plan.suggestion) if w]
        suggestion = f"; it would fit with {' or with '.join(ways)}" if ways else ""
        if config.data.max_prompt_length is None:
            suggestion += "; data.max_prompt_length would cut long prompts"
        raise PlanDoesNotFit(
            f"plan: {plan.summary()} (prompts up to {plan.sequence['prompt']} tokens){suggestion}. "
            "Change the config (see `ppokit plan`), or pass --ignore-plan to start anyway"
        )
    print(f"plan: {plan.summary()}", file=sys.stderr)
    for warning in plan.warnings:
        print(f"plan: warning: {warning}", file=sys.stderr)
    for suggestion in (plan.sharding_suggestion, plan.suggestion):
        if suggestion:
            print(f"plan: would fit with: {suggestion} (see `ppokit plan`)", file=sys.stderr)


def _plan(args) -> int:
    from ppokit.config.schema import PPOConfig
    from ppokit.training.startup import check_config

    config = PPOConfig.load(args.config, args.overrides)
    check_config(config, args.processes)
    if args.device_memory is not None and not 0 < args.device_memory < float("inf"):
        raise UserError(f"--device-memory {args.device_memory:g}: must be a number of GiB > 0")
    from ppokit.plan import plan_for, to_json  # torch and transformers, for the models on the meta device
    plan = plan_for(config, args.device_memory, args.processes, overwrite=args.overwrite)
    result(to_json(plan) if args.json else plan.render())
    for stop in plan.stops:  # `ppokit ppo` would stop on it, whatever the memory: a config error
        print(f"ppokit: error: {stop}", file=sys.stderr)
    return 2 if plan.stops else 0 if plan.fits else PLAN_DOES_NOT_FIT


def _demo(args) -> int:
    from ppokit.demos import reviews as demo  # no torch, no transformers: a demo that cannot start is refused at once

    choice = demo.DemoChoice.of(args.environment, args.quick, args.seed, args.estimator, args.engine)
    out = demo.demo_folder(choice, args.output, args.overwrite, args.resume)
    try:
        summary = demo.run(choice, out, overwrite=args.overwrite, resume=args.resume)
    except TrainingInterrupted as e:
        return _stopped(e, f"continue the demo with: {choice.command(out, '--resume')}")
    result(json.dumps(summary))
    return 0


def _stopped(e, next_step: str) -> int:
    """A run stopped by SIGINT/SIGTERM (guards.TrainingInterrupted): its line and what to do next, no traceback."""
    print(f"ppokit: {e}\nppokit: {next_step}", file=sys.stderr)
    return e.exit_code


def _quiet_transformers() -> None:
    """Load reports and per-shard progress bars drown the run's own progress; errors still show. Said through the
    environment, which transformers and huggingface_hub read when imported (a command imports them only once its
    config is read: a mistake in it is answered in a fraction of a second), unless the user set them; said to
    transformers directly where it is imported already (`main` called in-process)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()


def _sft(args) -> int:
    from ppokit.config.stages import SFTConfig

    config = SFTConfig.load(args.config, args.overrides)
    from ppokit.stages.sft import run_sft

    summary = run_sft(config, overwrite=args.overwrite)
    result(json.dumps({k: v for k, v in summary.items() if k not in ("length_rule", "chat_template")}))
    return 0


def _rm(args) -> int:
    from ppokit.config.stages import RMConfig

    config = RMConfig.load(args.config, args.overrides)
    from ppokit.stages.rm import run_rm

    summary = run_rm(config, overwrite=args.overwrite)
    result(json.dumps({k: v for k, v in summary.items() if k not in ("length_rule", "chat_template")}))
    return 0


def _pipeline(args) -> int:
    from ppokit.stages.pipeline import run_pipeline  # the stages themselves once the configs are read

    try:
        summaries = run_pipeline(args.config, args.overrides, overwrite=args.overwrite)
    except TrainingInterrupted as e:
        return _stopped(e, "run the pipeline again: a stage whose output is complete with this config is skipped")
    result(json.dumps({stage: {k: v for k, v in s.items() if k not in ("length_rule", "chat_template", "scores")} for stage, s in summaries.items()}))
    return 0


def _data_inspect(args) -> int:
    """One report per path (as a shell expands `data/*.jsonl`); a path that fails is one error
    line and the others are still reported; the exit status is 2 when any failed. With --config, the
    run's own prompts and rendering (`environments.conversation.conversation_for`: what its trainer reads, tools included)."""
    from ppokit.data.formats import load_records

    config = None
    if args.config:
        from ppokit.config.schema import PPOConfig

        config = PPOConfig.load(args.config, [])
        if args.chat_template is not None:
            config.data.chat_template = args.chat_template
    paths = args.paths or ([config.data.train] if config is not None and config.data.train else [])
    if not paths:
        raise UserError("data inspect: give a data path, or --config with data.train set")
    data_format = config.data.format if config is not None and args.format == "auto" else args.format
    failed = 0

    def failure(e: UserError) -> None:
        nonlocal failed
        if len(paths) == 1:
            raise e
        print(f"ppokit: error: {e}", file=sys.stderr)
        failed += 1

    loaded = []  # every path read first (no torch): a missing file or unknown format is answered at once
    for path in paths:
        try:
            loaded.append(load_records(path, data_format))
        except UserError as e:
            failure(e)
    if not loaded:
        return 2
    from ppokit.stages.data_inspect import format_report, inspect_data

    tokenizer = limit = render_prompts = None
    name = args.tokenizer or (config.tokenizer or config.model if config is not None else None)
    if name:
        from ppokit.models.loading import load_tokenizer, position_limit_of, resolve_model_path

        trust = config.trust_remote_code if config is not None else False
        tokenizer = load_tokenizer(name, trust)
        path = resolve_model_path(name, "tokenizer", tokenizer=True)
        if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
            limit = position_limit_of(name, "model")  # a model folder or id: rows over its positions too
    stage, max_prompt_length, response_length = args.stage, args.max_prompt_length, args.response_length
    if config is not None:
        from ppokit.environments.conversation import conversation_for

        stage = stage or "ppo"
        max_prompt_length = config.data.max_prompt_length if max_prompt_length == -1 else max_prompt_length
        response_length = response_length or config.response_room
        if tokenizer is not None:
            render_prompts = lambda dataset: conversation_for(config, tokenizer, [dataset]).template  # noqa: E731
    for i, records in enumerate(loaded):
        try:
            report = inspect_data(
                records, tokenizer, format=data_format, stage=stage, max_prompt_length=max_prompt_length,
                max_length=args.max_length, chat_template=args.chat_template, position_limit=limit,
                response_length=response_length, render_prompts=render_prompts,
            )
        except UserError as e:
            failure(e)
            continue
        if args.json:
            result(json.dumps(report))
        else:
            result(("\n" if i else "") + format_report(report))
    return 2 if failed else 0


def _limit(text: str):
    """A length limit on the command line: a whole number > 0, or none/null for no limit."""
    if text.lower() in ("none", "null"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number > 0 or none, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number > 0 or none, got {value}")
    return value


def _serve_rm(args) -> int:
    from ppokit.config.schema import positive, timeout_range

    token = None
    if args.token_env is not None:
        token = os.environ.get(args.token_env)
        if not token:
            raise UserError(f"serve-rm --token-env {args.token_env}: the environment variable {args.token_env} is not set or empty")
    for flag, value, check in (
        ("--workers", args.workers, positive), ("--read-timeout-s", args.read_timeout_s, timeout_range),
        ("--stuck-after-s", args.stuck_after_s, timeout_range), ("--max-request-bytes", args.max_request_bytes, positive),
        ("--max-rows", args.max_rows, positive), ("--timeout-s", args.timeout_s, timeout_range),
    ):
        if not check(value):
            raise UserError(f"serve-rm {flag}: {value} is out of range, it must be {check.requirement}")
    from ppokit.rewards import serve, source_from_argument

    source = source_from_argument(args.model, trust_remote_code=args.trust_remote_code, timeout_s=args.timeout_s)
    serve(
        source, args.host, args.port, max_request_bytes=args.max_request_bytes, max_rows=args.max_rows, verbose=args.verbose,
        workers=args.workers, read_timeout_s=args.read_timeout_s, stuck_after_s=args.stuck_after_s, token=token,
    )
    return 0


def _report(args) -> int:
    from ppokit.config.fields import apply_override, parse_override, read_yaml
    from ppokit.report import AlarmThresholds, make_report

    settings = read_yaml(args.thresholds) if args.thresholds else {}
    for text in args.threshold:
        apply_override(settings, *parse_override(text))
    thresholds = AlarmThresholds.from_mapping(settings, args.thresholds or "--threshold")
    if args.samples < 0:
        raise UserError(f"--samples {args.samples}: must be 0 or more")
    summary = make_report(args.run_dirs, args.output, thresholds, max_prompts=args.samples)
    print(f"report: {summary['output']} (figures in {os.path.dirname(summary['figures'][0]) if summary['figures'] else 'none'})", file=sys.stderr)
    for run in summary["runs"]:
        alarms = "; ".join(f"update {a['update']}: {a['title']}" for a in run["alarms"]) or "no alarms"
        print(f"report: {run['label']}: {run['updates']} updates, {alarms}", file=sys.stderr)
    for note in [f"{r['label']}: {n}" for r in summary["runs"] for n in r["skipped"]] + summary["skipped"]:
        print(f"report: skipped: {note}", file=sys.stderr)
    result(json.dumps(summary))
    return 0


def _from_trl(args) -> int:
    from ppokit.config.from_trl import convert

    return convert(args.config, args.output, result)


OVERWRITE_HELP = (
    "replace output_dir even when it is not a ppokit output (ppokit knows its own by the .ppokit marker in them; "
    "without this flag it replaces only those)"
)


def build_parser() -> argparse.ArgumentParser:
    from ppokit.config.schema import RewardConfig

    parser = argparse.ArgumentParser(prog="ppokit", description="PPO for language models: sft, reward models, ppo.")
    parser.add_argument("--version", action="version", version=f"ppokit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    ppo = sub.add_parser("ppo", help="run PPO from a YAML config")
    ppo.add_argument("config", help="YAML config file")
    ppo.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    ppo.add_argument(
        "--resume", nargs="?", const="latest", default=None, metavar="PATH",
        help="continue from the latest complete checkpoint in output_dir/checkpoints, or from PATH "
        "(a checkpoint folder, or a run folder: its latest checkpoint)",
    )
    ppo.add_argument(
        "--resume-force", action="store_true",
        help="resume even when config keys that change the result differ from the checkpoint's (they are listed)",
    )
    ppo.add_argument(
        "--overwrite", action="store_true",
        help="start afresh in an output_dir that holds a run (it is replaced once this run has its first checkpoint) "
        "or that ppokit did not make (only the names a run writes are replaced there)",
    )
    ppo.add_argument(
        "--ignore-plan", action="store_true",
        help=f"start even when the memory plan (`ppokit plan`) estimates that the run does not fit; without it such a run "
        f"stops before loading any weights, with exit status {PLAN_DOES_NOT_FIT}",
    )
    ppo.set_defaults(func=_ppo)

    for name, func, what in (
        ("sft", _sft, "supervised fine-tuning on prompt/completion or chat data"),
        ("rm", _rm, "train a reward model on preference pairs (Bradley-Terry)"),
        ("pipeline", _pipeline, "sft -> rm -> ppo from one YAML file with a section per stage"),
    ):
        stage = sub.add_parser(name, help=what)
        stage.add_argument("config", help="YAML config file")
        stage.add_argument("overrides", nargs="*", help="key.sub=value overrides")
        stage.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
        stage.set_defaults(func=func)

    data = sub.add_parser("data", help="look at a data source").add_subparsers(dest="data_command", required=True)
    inspect = data.add_parser("inspect", help="format, rows, lengths and examples of a data source as a stage sees it")
    inspect.add_argument("paths", nargs="*", metavar="path", help="data file, save_to_disk folder or hub dataset name; several give one report each "
                         "(default with --config: its data.train)")
    inspect.add_argument("--tokenizer", help="tokenizer or model path: lengths in tokens, and rows over the limits "
                         "(a model's also rows over its position limit)")
    inspect.add_argument("--format", default="auto", help="data format (default: detected from the columns)")
    inspect.add_argument("--stage", choices=("sft", "rm", "ppo"), help="read the data as this stage does (default: from the format)")
    inspect.add_argument("--max-prompt-length", type=_limit, default=-1, help="tokens, or none (default: the stage's data.max_prompt_length)")
    inspect.add_argument("--max-length", type=_limit, default=-1, help="tokens, or none (default: the stage's data.max_length)")
    inspect.add_argument("--chat-template", help="as data.chat_template (default: the tokenizer's, else plain)")
    inspect.add_argument("--response-length", type=_limit, help="ppo data: tokens sampled after each prompt, for the position limit (default: "
                                                                "ppo.response_length's default)")
    inspect.add_argument("--config", help="a PPO config: prompts rendered as that run renders them (its chat template and kwargs, its "
                         "environment's tools' schemas), with its tokenizer, data.max_prompt_length and token room unless given here")
    inspect.add_argument("--json", action="store_true", help="print each report as one JSON object on its own line")
    inspect.set_defaults(func=_data_inspect)

    plan = sub.add_parser(
        "plan", help="estimate parameters, memory and batch sizes of a PPO config (loads no weights, writes nothing)",
        description=f"Exit status: 0 when the estimate fits the device, {PLAN_DOES_NOT_FIT} when it does not, 2 on a config error "
        "or when `ppokit ppo` would stop on the config before training, on this machine, with the same line (its start-up checks: "
        "data, reward functions, output_dir, token budget, CUDA for fp16 and quantization, ...; prompt + response over a "
        "model's position limit). The estimate is still printed when it can be made.",
    )
    plan.add_argument("config", help="YAML config file, as for `ppokit ppo`")
    plan.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    plan.add_argument("--device-memory", type=float, metavar="GIB",
                      help="plan for a device of this many GiB instead of this machine's (CUDA memory, else RAM)")
    plan.add_argument("--processes", type=int, metavar="N",
                      help="plan per device of N processes, under ddp and fsdp (default: WORLD_SIZE, else 1)")
    plan.add_argument("--overwrite", action="store_true",
                      help="check output_dir as `ppokit ppo --overwrite` does (a folder ppokit did not make is then accepted)")
    plan.set_defaults(func=_plan)

    from_trl = sub.add_parser(
        "from-trl", help="write the ppokit config of a TRL GRPO config (GRPOConfig's YAML): the translation on stderr",
        description="Each key becomes ppokit's (docs/trl.md), with ppo.advantage_estimator: grpo (TRL's GRPOTrainer: no value "
        "model) and TRL's defaults where ppokit's differ and the file sets none; a key with no translation is an error naming it.",
    )
    from_trl.add_argument("config", help="the TRL GRPO config (YAML)")
    from_trl.add_argument("-o", "--output", metavar="PATH", help="write the ppokit config here (default: stdout)")
    from_trl.set_defaults(func=_from_trl)

    from ppokit.demos.reviews import ENVIRONMENTS as DEMO_ENVIRONMENTS  # no torch: the parser stays quick
    from ppokit.engines import ENGINES
    from ppokit.training.estimators import ESTIMATORS

    demo = sub.add_parser("demo", help="the embedded demos: SFT then PPO towards positive movie reviews, or a game, a tool or a reasoning-gym task "
                                       "(--environment)")
    demo.add_argument("--quick", action="store_true", help="a smaller run, about a minute on 2 cores")
    demo.add_argument("--output", default=None,
                      help="directory for data/, sft/ and ppo/ (default: each demo its own, ppokit-demo for the quick movie-review "
                      "demo, then -ENVIRONMENT, -ENGINE, -ESTIMATOR when not the default, -full without --quick)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--estimator", default=None, choices=list(ESTIMATORS),
                      help="ppo.advantage_estimator of the PPO step, with its usual samples per prompt (docs/algorithms.md; default: "
                      "the demo's own, gae for the movie reviews)")
    demo.add_argument("--engine", default="hf", choices=list(ENGINES),
                      help="rollout.engine of the PPO step (docs/rollout.md; default: hf). With vllm the demo model has head_dim 64 "
                      "(vLLM's CPU attention serves none under 32)")
    demo.add_argument("--overwrite", action="store_true",
                      help="replace the run in DIR/ppo left by an earlier demo, or write into a folder the demo did not make "
                      "(without it both are refused before any work)")
    demo.add_argument("--resume", action="store_true",
                      help="continue a demo stopped by Ctrl-C (the same command with --resume): from its last checkpoint, to the "
                      "figures it would have reached without the stop")
    demo.add_argument("--environment", choices=list(DEMO_ENVIRONMENTS), default=None,
                      help="another demo instead: guess (a number from 1 to 16; the environment answers higher/lower/correct) "
                      "or calculator (arithmetic with a calculator tool the model calls; calculator-agent: the same task made by an "
                      "openai agent program, docs/agents.md); or reasoning-gym (a task of reasoning-gym's, scored by its own "
                      "score_answer; needs ppokit[reasoning-gym])")
    demo.set_defaults(func=_demo)

    report = sub.add_parser(
        "report", help="HTML report of one or more runs: curves, reward-vs-KL frontier, samples and over-optimisation alarms",
        description="Reads only the run directories (config.yaml, metrics.jsonl, samples.jsonl): works on finished, running "
        "and crashed runs. Alarm thresholds are explained in docs/report.md.",
    )
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run directory (a PPO run's output_dir); several are overlaid")
    report.add_argument("--output", default="report.html", help="the "
                                                                "HTML file (default report.html); each chart also goes to <name>_figures/ beside it, as SVG")
    report.add_argument("--thresholds", metavar="FILE", help="YAML mapping of alarm thresholds (docs/report.md lists them)")
    report.add_argument("--threshold", action="append", default=[], metavar="KEY=VALUE", help="set one alarm threshold (repeatable; after --thresholds)")
    report.add_argument("--samples", type=int, default=4, metavar="N", help="eval prompts whose completions are shown (default 4)")
    report.set_defaults(func=_report)

    serve_rm = sub.add_parser("serve-rm", help="serve a reward model or reward function over HTTP (the reward.remote protocol)")
    serve_rm.add_argument("model", help="a saved reward model directory, a reward function (`sentiment`, `file.py:fn`, `module:fn`) or a YAML mapping such as "
                                        "'{function: contains, required: [great]}'")
    serve_rm.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only; beyond it, set --token-env)")
    serve_rm.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one and prints it)")
    serve_rm.add_argument("--token-env", metavar="VAR", help="require `Authorization: Bearer <token>` on every POST, the token read from environment variable "
                                                             "VAR "
                          "(clients send it with reward.remote.headers: {Authorization: \"Bearer ${VAR}\"})")
    serve_rm.add_argument("--max-request-bytes", type=int, default=16 << 20, help="larger requests are refused with HTTP 413 (default 16 MiB)")
    serve_rm.add_argument("--max-rows", type=int, default=4096, help="rows per request at most (default 4096)")
    serve_rm.add_argument("--workers", type=int, default=8, help="requests handled (parsed, scored) at once, each in a thread (default 8); any more get HTTP "
                                                                 "503 at once")
    serve_rm.add_argument("--read-timeout-s", type=float, default=30.0, help="a client must send its whole request within this time, else it is closed "
                                                                             "(default 30)")
    serve_rm.add_argument("--stuck-after-s", type=float, default=60.0, help="a scoring call running longer than this makes GET / answer 503 and new POSTs get "
                                                                            "503 instead of waiting (default 60)")
    serve_rm.add_argument("--timeout-s", type=float, default=RewardConfig.timeout_s,
                          help=f"a reward function's deadline per call, as reward.timeout_s (default {RewardConfig.timeout_s:g}); the request then gets HTTP "
                               "422")
    serve_rm.add_argument("--trust-remote-code", action="store_true", help="allow the model repository to run its own Python code")
    serve_rm.add_argument("--verbose", action="store_true", help="log every request to stderr")
    serve_rm.set_defaults(func=_serve_rm)
    return parser


def _one_line_warnings() -> None:
    # ppokit's own warnings (e.g. reward.on_error=skip dropping rows) are for the user, not a source line:
    # print them as one line, above the progress bar rather than through it.
    package_dir = os.path.dirname(os.path.abspath(__file__))
    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if os.path.abspath(filename).startswith(package_dir + os.sep):
            from tqdm.auto import tqdm  # here, not at start: a command that warns nothing stays quick

            tqdm.write(f"ppokit: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show


_program = False  # main() runs as the program (the `ppokit` script, python -m ppokit): it may start itself again


def _start_again_with(cpu_allocator: Optional[str]) -> None:
    """`cpu_allocator`: the program replaces itself (exec: the same process id, command line and environment, plus
    LD_PRELOAD) with one whose malloc is that library's, unless it runs with it already (`allocator.preload_environment`;
    a one-line error where the library is missing). In-process (main(argv)) nothing is replaced: the trainer's start-up
    check says what to do."""
    if cpu_allocator is None or not _program:
        return
    from ppokit.process import allocator

    environ = allocator.preload_environment(cpu_allocator)
    if environ is None:
        return
    for stream in (sys.stdout, sys.stderr, _results):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    if _results is not None and _results is not sys.__stdout__:  # the real stdout back on descriptor 1 (results_alone_on_stdout)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(_results.fileno(), 1)
    os.execve(sys.executable, sys.orig_argv, environ)


def main(argv: list[str] | None = None) -> int:
    global _program
    if argv is None:  # the program itself (the `ppokit` script, python -m ppokit), not a call in-process
        _program = True
        interrupts.act_on_ctrl_c()
        cpu_threads.settle()  # before torch is imported: its OpenMP runtime reads them when loaded
        return _leave(main(sys.argv[1:]))
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C anywhere, heavy imports and model loading included: one line, no traceback
        print("ppokit: interrupted", file=sys.stderr)
        return 130  # the shell's convention for SIGINT


def _main(argv: list[str]) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = _parse_args(build_parser(), argv)
    _quiet_transformers()
    had_process_group = _process_group_initialized()
    # serve-rm's stdout is its one line saying where it serves, written before any request reaches the user's code
    results = contextlib.nullcontext() if args.func is _serve_rm else results_alone_on_stdout()
    with warnings.catch_warnings(), results:  # restores warnings.showwarning when main is called in-process
        _one_line_warnings()
        try:
            return args.func(args)
        except UserError as e:
            # one write: under torchrun (python -u) print's text and newline are two, and the lines of two
            # processes failing together interleave
            sys.stderr.write(f"ppokit: error: {e}\n")
            sys.stderr.flush()
            e.before_exit()
            return getattr(e, "exit_code", 2)
        finally:
            if not had_process_group:
                _end_process_group()


_results: Optional[TextIO] = None  # where `result` writes while a command runs (`results_alone_on_stdout`)


def result(text: str) -> None:
    """A command's result, one write to stdout (the real one while `results_alone_on_stdout` holds it aside)."""
    stream = _results if _results is not None else sys.stdout
    stream.write(text + "\n")
    stream.flush()


@contextlib.contextmanager
def results_alone_on_stdout() -> Iterator[None]:
    """While a command runs, stdout holds its results alone (`result`): what anything else writes there (an environment,
    a reward function, a library they call, C code or a process they start; a partial line once glued itself to the
    final JSON line) goes to stderr. At the file-descriptor level, so that os.write(1, ...) and C's stdio are
    redirected too: descriptor 1 leads to stderr's file and sys.stdout is sys.stderr meanwhile; the real stdout is
    kept on a descriptor of its own, which `result` writes to."""
    global _results
    try:
        sys.stdout.flush()
        kept = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no stdout to protect (closed): as it is
        kept = None
    if kept is None:
        yield
        return
    try:
        real = sys.stdout.fileno() == 1
    except (OSError, ValueError, AttributeError):  # a stream of its own (a test's capture): results go to it
        real = False
    before, previous = sys.stdout, _results
    _results = open(kept, "w", encoding=getattr(before, "encoding", None) or "utf-8", closefd=False) if real else before
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = before
        for stream in (before, sys.__stdout__):  # what user code wrote into them before the swap, or around it
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        _flush_c_stdio()
        os.dup2(kept, 1)
        if real:
            with contextlib.suppress(OSError, ValueError):
                _results.close()
        os.close(kept)
        _results = previous


def _flush_c_stdio() -> None:
    """C code's buffered stdout (printf without a newline) goes out while descriptor 1 still leads to stderr."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).fflush(None)


def _parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments, with `key=value` overrides accepted after the flags too (`ppokit ppo c.yaml
    --resume a=1 b=2`, `--overwrite output_dir=x`): argparse leaves those over, or takes the first for
    --resume's optional PATH; they join the overrides in the order given."""
    args, extra = parser.parse_known_args(argv)
    if not hasattr(args, "overrides"):
        return parser.parse_args(argv)  # a command without overrides: argparse's own message for leftovers
    resume = getattr(args, "resume", None)
    if resume not in (None, "latest") and "=" in resume and not os.path.exists(resume):
        args.overrides.append(resume)
        args.resume = "latest"
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides += extra
    return args


def _process_group_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")  # not imported: no group, and the parser stays quick
    return dist is not None and dist.is_available() and dist.is_initialized()


def _leave(code: int) -> NoReturn:
    """Exit with `code` as the interpreter's shutdown would up to its last part (non-daemon threads joined, atexit
    handlers run, stdout and stderr flushed), without that part: a thread still running there wakes inside torch's
    C++ code and aborts the finished process (SIGABRT, "terminate called without an active exception"; under torchrun
    the whole launch fails). Such threads: a reward or environment call left running past its deadline, the user's
    own daemon threads, gloo's workers freeing tensors under the GIL."""
    import atexit
    import contextlib
    import threading

    threading._shutdown()  # what the interpreter runs first: executors' exit hooks, non-daemon threads joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone (`ppokit ... | head`) or a stream closed
            stream.flush()
    os._exit(code)


def _end_process_group() -> None:
    """Destroy the process group this command created (accelerate's, or fsdp's group of one). Left to
    interpreter exit, gloo's worker threads are torn down after Python, and a process that finished its
    work cleanly aborts now and then ("terminate called without an active exception", SIGABRT), failing
    the whole torchrun launch."""
    if _process_group_initialized():
        sys.modules["torch.distributed"].destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
