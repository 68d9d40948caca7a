"""Multi-turn rollouts with a tool of realistic latency: episodes/s and model tokens/s of the per-episode loop against
the lock-step loop it replaced; one JSON line per case.

The demo game's SFT'd tiny Llama (`ppokit.demos.guess`, built once into --work, ~1 minute on 2 cores) plays episodes of
1 to 6 turns (each row's own number, drawn from a fixed seed) against `LatentTool`, an environment whose every call
takes, with tools `slow`, 1 s for 10% of the calls and 10 ms for the others (which calls, fixed by the row and turn:
the same for every loop), and with tools `instant` no time at all; each call under environment_timeout_s 60 (on
worker threads), and the instant tool also without a deadline (null: each call in the loop's own thread). Cases:
loop (`per-episode`: this checkout's `EpisodeLoop`; `lock-step`: the loop of --base, 990d034 by default, extracted
with `git archive` and run in a subprocess: one batched generate per turn for every running episode, then every
environment's step) x tools and deadline x engine
(`hf`; `vllm` with --engine vllm, run under the vLLM venv's python). Each case runs --repeats batches of --episodes
episodes after one warm-up batch; the figures are medians. Every line carries the machine's load average (the
2-core machine is shared: compare lines measured together) and, for the per-episode loop, a digest of the episodes
(tokens, logprobs, rewards): the same digest with slow and instant tools is the same episodes whatever the latency.
With hf, `forwards_per_batch` counts the policy's forwards in a batch (the engine's decoding and reading steps).

    PYTHONPATH=src python benchmarks/multiturn.py [--episodes 64] [--repeats 2] [--engine hf] [--work DIR] [--base 990d034] [--device cuda]
    PYTHONPATH=src ~/.cache/ppokit-ci/vllm-*/bin/python benchmarks/multiturn.py --engine vllm
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

MAX_TURNS = 6
SLOW_SHARE, SLOW_S, FAST_S = 0.10, 1.0, 0.010


def latency(row: int, turn: int, tools: str) -> float:
    """The time one call takes: fixed by (row, turn), so that every loop meets the same slow calls."""
    if tools == "instant":
        return 0.0
    return SLOW_S if random.Random(row * 1000 + turn).random() < SLOW_SHARE else FAST_S


class LatentTool:
    """The benchmark's environment: the episode lasts its row's `turns` (1-6) steps, each answering "higher" or "lower"
    (reward 1 for a turn whose first word is a number) after `latency(row, turn)` seconds."""

    def __init__(self, tools: str = "slow"):
        self.tools = tools

    def reset(self, row):
        self.row, self.turns, self.turn = int(row["id"]), int(row["turns"]), 0
        time.sleep(latency(self.row, -1, self.tools))

    def step(self, completion):
        time.sleep(latency(self.row, self.turn, self.tools))
        self.turn += 1
        words = completion.split()
        return ("higher" if self.turn % 2 else "lower"), float(bool(words) and words[0].isdigit()), self.turn >= self.turns


def rows(n: int) -> list[dict]:
    turns = random.Random(0)
    return [{"prompt": "guess a number from 1 to 16 .", "id": i, "turns": turns.randint(1, MAX_TURNS)} for i in range(n)]


def build_engine(name: str, model, tokenizer, rows_per_forward: int, longest: int, device: str = "cpu"):
    import inspect

    import torch

    if name == "hf":
        from ppokit.engines.hf import HFEngine

        extra = {"max_sequence": longest} if "max_sequence" in inspect.signature(HFEngine).parameters else {}
        return HFEngine(model, tokenizer.pad_token_id, torch.device(device), rows_per_forward=rows_per_forward, **extra)
    from ppokit.engines.vllm import VLLMEngine

    return VLLMEngine(model, tokenizer.pad_token_id, longest, max_num_seqs=rows_per_forward, seed=0)


def run_cases(args, loop_name: str) -> list[dict]:
    """Every tools case of one loop (this process's ppokit) -> one result per case."""
    import inspect

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ppokit
    from ppokit.engines.base import Sampling
    from ppokit.environments.base import EnvironmentRunner
    from ppokit.environments.episode_loop import EpisodeLoop

    torch.set_num_threads(args.threads)
    work = model_folder(args)
    tokenizer = AutoTokenizer.from_pretrained(work / "sft")
    model = AutoModelForCausalLM.from_pretrained(work / "sft").eval().to(args.device)
    forwards = [0]  # calls of the policy module: the hf engine's forwards (vLLM runs a model of its own)
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    data = rows(args.episodes)
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in data]
    budget = MAX_TURNS * 4
    engine = build_engine(args.engine, model, tokenizer, args.episodes, max(map(len, prompts)) + budget, args.device)
    # the stop token's keyword as each loop's ppokit names it (one id then, a list of them since)
    stop = "stop_token_ids" if "stop_token_ids" in inspect.signature(Sampling).parameters else "stop_token_id"
    sampling = Sampling(max_new_tokens=3, temperature=1.0, **{stop: tokenizer.eos_token_id})
    results = []
    for tools, deadline_s in (("instant", 60.0), ("instant", None), ("slow", 60.0)):
        runner = EnvironmentRunner(f"{__file__}:LatentTool", LatentTool, {"tools": tools}, timeout_s=deadline_s)
        loop = EpisodeLoop(engine, tokenizer, runner, max_turns=MAX_TURNS, max_episode_tokens=budget, pad_token_id=tokenizer.pad_token_id)

        def sample():
            torch.manual_seed(0)
            out = loop.sample(prompts, [dict(r) for r in data], sampling)
            return out[0] if isinstance(out, tuple) else out  # the lock-step loop returned (Episodes, EpisodeOutcome)

        sample()  # warm-up
        forwards[0] = 0
        seconds, tokens, turns, digests = [], [], [], set()
        for _ in range(args.repeats):
            load = os.getloadavg()[0]
            start = time.perf_counter()
            episodes = sample()
            seconds.append(time.perf_counter() - start)
            tokens.append(int(episodes.loss_mask.sum()))
            turns.append(float((episodes.loss_mask[:, 1:] & ~episodes.loss_mask[:, :-1]).sum() + episodes.loss_mask[:, 0].sum()) / len(data))
            digests.add(digest(episodes))
        t = statistics.median(seconds)
        results.append({
            "benchmark": "multiturn", "loop": loop_name, "engine": args.engine, "tools": tools, "environment_timeout_s": deadline_s, "episodes": args.episodes,
            "repeats": args.repeats, "episodes_per_s": round(args.episodes / t, 2), "model_tokens_per_s": round(statistics.median(tokens) / t, 1),
            "forwards_per_batch": forwards[0] / args.repeats if args.engine == "hf" else None,
            "mean_turns": round(statistics.mean(turns), 3), "seconds": round(t, 3), "load_avg_1min": round(load, 2),
            "digest": sorted(digests)[0] if len(digests) == 1 else "differs between repeats", "threads": torch.get_num_threads(), "device": args.device,
            "ppokit": str(Path(ppokit.__file__).parent.parent),
        })
    return results


def model_folder(args) -> Path:
    """Where the engine's demo model is built: one per engine (vLLM's CPU attention needs the demo's head_dim-64 model)."""
    return Path(args.work) / args.engine


def digest(episodes) -> str:
    """A fingerprint of what was sampled: the tokens, the trained mask, the logprobs' bits."""
    h = hashlib.sha256()
    for tensor in (episodes.response_ids, episodes.loss_mask, episodes.logprobs):
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def base_source(commit: str, where: Path) -> Path:
    """The `src` folder of `commit` of this repository (git archive), extracted once into `where` (the --work folder:
    carried with it to a machine without the repository's history)."""
    target = where / f"ppokit-{commit}"
    if not (target / "src" / "ppokit").is_dir():
        repo = Path(__file__).resolve().parent.parent
        archive = subprocess.run(["git", "archive", "--format=tar", commit, "src"], cwd=repo, check=True, capture_output=True).stdout
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile() as f:
            f.write(archive)
            f.seek(0)
            with tarfile.open(fileobj=f) as tar:
                tar.extractall(target, filter="data")
    return target / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    parser.add_argument("--device", default="cpu", help="where the hf engine's model runs (cuda: a GPU)")
    parser.add_argument("--work", default=None, help="where the demo's SFT models are built, one per engine (reused if there); default a temporary folder")
    parser.add_argument("--base", default="990d034", help="the commit whose lock-step loop is measured; 'none': skip it")
    parser.add_argument("--only", choices=("per-episode", "lock-step"), default=None, help=argparse.SUPPRESS)  # the subprocess's
    args = parser.parse_args()
    args.work = args.work or tempfile.mkdtemp(prefix="ppokit-multiturn-")
    if args.only is not None:
        for line in run_cases(args, args.only):
            print(json.dumps(line), flush=True)
        return
    if not (model_folder(args) / "sft").is_dir():
        from ppokit.demos import guess as demo_game

        demo_game.prepare_game_demo(model_folder(args), quick=True, seed=0, say=lambda *a: print(*a, file=sys.stderr), engine=args.engine)
    if args.base != "none":
        src = base_source(args.base, Path(args.work))
        command = [sys.executable, __file__, "--only", "lock-step", "--episodes", str(args.episodes), "--repeats", str(args.repeats),
                   "--engine", args.engine, "--threads", str(args.threads), "--work", args.work, "--device", args.device]
        subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(src)})
    for line in run_cases(args, "per-episode"):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
