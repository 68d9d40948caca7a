"""Multi-turn rollouts on the demo game: episodes/s and model tokens/s for 1, 2 and 4 turns; one JSON line.

The demo's guessing game (`ppokit.demo_game`: GuessNumber, a number from 1 to 16) with its SFT'd
tiny Llama (built once into --work, ~1 minute on 2 cores), sampled through the episode loop over the
`hf` rollout engine: every turn is one batched generate call for the unfinished episodes. Each
setting runs `--repeats` batches of `--episodes` episodes after one warm-up batch; the figures are
medians. rollout/turns says how many turns the episodes took (a won game ends early).

    PYTHONPATH=src python benchmarks/multiturn.py [--episodes 64] [--repeats 3] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", default=None, help="where the demo's SFT model is built (reused if there); default a temporary folder")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppokit import demo_game
    from ppokit.engines.base import Sampling
    from ppokit.engines.hf import HFEngine
    from ppokit.environments.episode_loop import conversation_setup, episode_source
    from ppokit.environments.guess import guess_rows
    from ppokit.metric_values import episode_metrics

    work = Path(args.work or tempfile.mkdtemp(prefix="ppokit-multiturn-"))
    if not (work / "sft").is_dir():
        demo_game.prepare_game_demo(work, quick=True, seed=0, say=lambda *a: print(*a, file=sys.stderr))
    tokenizer = AutoTokenizer.from_pretrained(work / "sft")
    model = AutoModelForCausalLM.from_pretrained(work / "sft").eval()
    engine = HFEngine(model, tokenizer.pad_token_id, torch.device("cpu"), rows_per_forward=64)
    rows = guess_rows(1, args.episodes)
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    sampling = Sampling(max_new_tokens=3, temperature=1.0, stop_token_ids=tokenizer.eos_token_id)
    result = {"benchmark": "multiturn", "episodes": args.episodes, "repeats": args.repeats, "threads": torch.get_num_threads()}
    for turns in (1, 2, 4):
        conversation = conversation_setup(tokenizer, chat_template=None, template_kwargs=None, datasets=[], environment=demo_game.GAME,
                                          environment_args={}, timeout_s=None, max_turns=turns, stop_token_ids=tokenizer.eos_token_id)
        source = episode_source(engine, conversation, max_turns=turns, max_episode_tokens=turns * 3, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        source.sample(prompts, rows, sampling)  # warm-up
        seconds, tokens, mean_turns = [], [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            episodes = source.sample(prompts, rows, sampling)
            seconds.append(time.perf_counter() - start)
            tokens.append(int(episodes.model_tokens.sum()))
            mean_turns.append(episode_metrics(episodes)["rollout/turns"])
        t = statistics.median(seconds)
        result[f"turns_{turns}"] = {
            "episodes_per_s": round(args.episodes / t, 1), "model_tokens_per_s": round(statistics.median(tokens) / t, 1),
            "mean_turns": round(statistics.mean(mean_turns), 2), "seconds": round(t, 3),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
