"""Run the same configs with two commits of ppokit and compare their metrics, bit for bit.

    python scripts/compare_runs.py OLD NEW [--work DIR] [--episodes N]

OLD, NEW: git revisions of this repository (NEW may be `.`, the working tree as it is). Each runs
from its own `git worktree` (its src/ on PYTHONPATH), the two side by side:

    demo    `ppokit demo --quick` (SFT, then PPO with gae): its ppo/metrics.jsonl and samples.jsonl
    grpo    PPO from the demo's SFT model, grpo with 4 samples per prompt
    budget  PPO from the demo's SFT model, gae with ppo.max_tokens_per_micro_batch (packed micro-batches)

The grpo and budget runs of both commits start from OLD's demo SFT model and config.yaml, so they
differ only by the code. Compared: every metrics.jsonl value but timings (`time/*`, `eps`), and
samples.jsonl. Prints one JSON line per run and exits 1 if any differs. A result is the same on one
machine only; float32 results differ in the last bits between CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIMINGS = ("time/", "eps")


def worktree(rev: str, work: Path) -> Path:
    if rev == ".":
        return REPO
    tree = work / f"tree-{rev.replace('/', '_')}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
    return tree


def ppokit(tree: Path, args: list[str], log: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-m", "ppokit.cli", *args], env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"compare_runs: `ppokit {' '.join(args)}` failed in {tree} (exit {done.returncode}); see {log}")


def records(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not k.startswith(TIMINGS)} for row in rows]


def compare(name: str, old: Path, new: Path) -> dict:
    result = {"run": name, "updates": len(records(old / "metrics.jsonl"))}
    for file in ("metrics.jsonl", "samples.jsonl"):
        a, b = records(old / file), records(new / file)
        differing = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        same = len(a) == len(b) and not differing
        result[file] = "identical" if same else f"DIFFERENT (rows {len(a)} vs {len(b)}, first differing row {differing[:1]})"
        if not same and differing:
            x, y = a[differing[0]], b[differing[0]]
            result[f"{file} keys"] = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))[:8]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--work", type=Path, help="folder for the worktrees and runs (default: a new temporary one)")
    parser.add_argument("--episodes", type=int, default=256, help="ppo.total_episodes of the grpo and budget runs")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="compare-runs-"))
    work.mkdir(parents=True, exist_ok=True)
    trees = {"old": worktree(args.old, work), "new": worktree(args.new, work)}
    print(f"compare_runs: {args.old} vs {args.new} in {work}", file=sys.stderr)

    def both(run):  # old and new side by side: each takes a core
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(run, trees))

    both(lambda side: ppokit(trees[side], ["demo", "--quick", "--output", str(work / side / "demo")], work / f"{side}-demo.log"))
    config = str(work / "old" / "demo" / "ppo" / "config.yaml")
    runs = {
        "grpo": ["ppo.advantage_estimator=grpo", "ppo.num_samples_per_prompt=4"],
        "budget": ["ppo.max_tokens_per_micro_batch=256"],
    }
    for name, overrides in runs.items():
        both(lambda side: ppokit(trees[side], ["ppo", config, f"output_dir={work / side / name}",
                                               f"ppo.total_episodes={args.episodes}", *overrides], work / f"{side}-{name}.log"))
    results = [compare("demo", work / "old" / "demo" / "ppo", work / "new" / "demo" / "ppo")]
    results += [compare(name, work / "old" / name, work / "new" / name) for name in runs]
    for result in results:
        print(json.dumps(result))
    return 0 if all(r["metrics.jsonl"] == r["samples.jsonl"] == "identical" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
