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


def _serve_rm(args) -> int:
    from ppokit.rewards import serve, source_from_argument

    source = source_from_argument(args.model, trust_remote_code=args.trust_remote_code)
    serve(source, args.host, args.port, max_request_bytes=args.max_request_bytes, max_rows=args.max_rows, verbose=args.verbose)
    return 0


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

    serve_rm = sub.add_parser("serve-rm", help="serve a reward model or reward function over HTTP (the reward.remote protocol)")
    serve_rm.add_argument("model", help="a saved reward model directory, a reward function (`sentiment`, `file.py:fn`, `module:fn`) or a YAML mapping such as '{function: contains, required: [great]}'")
    serve_rm.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only; there is no authentication)")
    serve_rm.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one and prints it)")
    serve_rm.add_argument("--max-request-bytes", type=int, default=16 << 20, help="larger requests are refused with HTTP 413 (default 16 MiB)")
    serve_rm.add_argument("--max-rows", type=int, default=4096, help="rows per request at most (default 4096)")
    serve_rm.add_argument("--trust-remote-code", action="store_true", help="allow the model repository to run its own Python code")
    serve_rm.add_argument("--verbose", action="store_true", help="log every request to stderr")
    serve_rm.set_defaults(func=_serve_rm)
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
