"""`ppokit` command line: parse, call, print. User errors exit 2 with one line, no traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ppokit.errors import UserError


def _ppo(args) -> int:
    from ppokit.config import PPOConfig
    from ppokit.trainer import PPOTrainer

    config = PPOConfig.load(args.config, args.overrides)
    trainer = PPOTrainer(config)
    records = trainer.train()
    print(json.dumps({"output_dir": config.output_dir, "updates": len(records), "final_score": records[-1]["objective/scores"]}))
    return 0


def _demo(args) -> int:
    from ppokit.demo import run_demo

    summary = run_demo(args.output, quick=args.quick, seed=args.seed)
    print(json.dumps(summary))
    return 0


def _quiet_transformers() -> None:
    # Load reports and per-shard progress bars drown the run's own progress; errors still show.
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ppokit", description="PPO for language models: sft, reward models, ppo.")
    sub = parser.add_subparsers(dest="command", required=True)

    ppo = sub.add_parser("ppo", help="run PPO from a YAML config")
    ppo.add_argument("config", help="YAML config file")
    ppo.add_argument("overrides", nargs="*", help="key.sub=value overrides")
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
    _quiet_transformers()
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
