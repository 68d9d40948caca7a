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
    _preflight(config)
    trainer = PPOTrainer(config)
    records = trainer.train()
    print(json.dumps({"output_dir": config.output_dir, "updates": len(records), "final_score": records[-1]["objective/scores"]}))
    return 0


def _preflight(config) -> None:
    """The plan's verdict before any weights load: a warning, never a failure."""
    from ppokit.plan import plan_for

    try:
        plan = plan_for(config)
    except Exception as e:  # an estimate must never stop a run that might fit
        print(f"plan: skipped ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", file=sys.stderr)
        return
    print(f"plan: {plan.summary()}", file=sys.stderr)
    for warning in plan.warnings:
        print(f"plan: warning: {warning}", file=sys.stderr)
    if plan.suggestion:
        print(f"plan: would fit with: {plan.suggestion} (see `ppokit plan`)", file=sys.stderr)


PLAN_DOES_NOT_FIT = 3


def _plan(args) -> int:
    from ppokit.config import PPOConfig
    from ppokit.plan import plan_for, to_json

    config = PPOConfig.load(args.config, args.overrides)
    plan = plan_for(config, args.device_memory)
    print(to_json(plan) if args.json else plan.render())
    return 0 if plan.fits else PLAN_DOES_NOT_FIT


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
    ppo.set_defaults(func=_ppo)

    plan = sub.add_parser(
        "plan", help="estimate parameters, memory and batch sizes of a PPO config (reads config files only)",
        description=f"Exit status: 0 when the estimate fits the device, {PLAN_DOES_NOT_FIT} when it does not, 2 on a config error.",
    )
    plan.add_argument("config", help="YAML config file, as for `ppokit ppo`")
    plan.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    plan.add_argument("--device-memory", type=float, metavar="GIB",
                      help="plan for a device of this many GiB instead of this machine's (CUDA memory, else RAM)")
    plan.set_defaults(func=_plan)

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
