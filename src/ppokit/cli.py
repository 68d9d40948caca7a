"""`ppokit` command line: parse, call, print. User errors exit 2 with one line, no traceback."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from ppokit.errors import UserError


def _ppo(args) -> int:
    from ppokit import checkpoint
    from ppokit.config import PPOConfig
    from ppokit.guards import TrainingInterrupted

    overrides, resume = list(args.overrides), args.resume
    if resume is not None and resume != "latest" and "=" in resume and not os.path.exists(resume):
        overrides.append(resume)  # `--resume a.b=1`: argparse took an override for the optional path
        resume = "latest"
    if args.resume_force and resume is None:
        raise UserError("--resume-force only applies with --resume")
    config = PPOConfig.load(args.config, overrides)
    # Find the checkpoint (or refuse to start over an unfinished run) before loading any weights.
    if resume is not None:
        resume_path = checkpoint.find_checkpoint(None if resume == "latest" else resume, config.output_dir)
    else:
        resume_path = None
        unfinished = checkpoint.unfinished_run(config.output_dir)
        if unfinished:
            path, state = unfinished
            raise UserError(
                f"{config.output_dir} holds an unfinished run (checkpoint {path.name} of {state['num_updates']} updates): "
                f"continue it with --resume, or delete {checkpoint.checkpoints_dir(config.output_dir)} to start over"
            )
    from ppokit.trainer import PPOTrainer

    trainer = PPOTrainer(config)
    if resume_path is not None:
        trainer.resume_from(resume_path, force=args.resume_force)
        print(f"ppokit: resumed from {resume_path} (update {trainer.update} of {trainer.sizes.num_updates})", file=sys.stderr)
        if trainer.update >= trainer.sizes.num_updates:
            print("ppokit: that checkpoint is the end of the run; nothing left to train", file=sys.stderr)
    try:
        records = trainer.train()
    except TrainingInterrupted as e:
        command = shlex.join(["ppokit", "ppo", args.config, *overrides, "--resume"])
        print(f"ppokit: {e}\nppokit: resume with: {command}", file=sys.stderr)
        return e.exit_code
    scores = [r["objective/scores"] for r in records if "objective/scores" in r]
    print(json.dumps({"output_dir": config.output_dir, "updates": len(records), "final_score": scores[-1] if scores else None}))
    return 0


def _demo(args) -> int:
    from ppokit.demo import run_demo

    summary = run_demo(args.output, quick=args.quick, seed=args.seed)
    print(json.dumps(summary))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ppokit", description="PPO for language models: sft, reward models, ppo.")
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
    ppo.set_defaults(func=_ppo)

    demo = sub.add_parser("demo", help="the embedded demo: SFT then PPO towards positive movie reviews")
    demo.add_argument("--quick", action="store_true", help="a smaller run, under a minute on 2 cores")
    demo.add_argument("--output", default="ppokit-demo", help="directory for data/, sft/ and ppo/ (default: ppokit-demo)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"ppokit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ppokit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
