"""Sampling speed and memory of the rollout engines (`rollout.engine`: hf, vllm), and a full PPO update with
each; one JSON line per configuration.

    python benchmarks/rollout_engines.py [--modes sampling,ppo,requests] [--sizes small,50m] [--engines hf,vllm] [--repeats 3]
                                         [--updates 2]

Two Llamas built locally with head_dim 64 (vLLM's CPU attention needs >= 32) and the demo's word-level
vocabulary: `small` (hidden 128, 2 layers, 2 heads: ~0.3M parameters) and `50m` (hidden 768, 9 layers,
12 heads: ~50M). 64 prompts of the demo task x 64 new tokens, temperature 1, no stop token (every
row decodes all 64 tokens), float32. Each configuration runs in a process of its own; one warm-up
generate, then `repeats` timed ones: tokens_per_s is the median (best beside it). peak_rss_mb is the
process's peak (model, engine and KV cache included); sync_s (vllm) the median time of one
`sync_weights` (every weight sent into the running engine). vLLM on CPU: in-process, eager, KV cache
sized for the batch.

--modes ppo: the same models through the real trainer (`ppokit.trainer.PPOTrainer`, `rollout.engine` set,
VADER sentiment as the reward): 32 episodes per update (2 minibatches of 16), 1 PPO epoch, 32-token
responses without a stop token, a critic of the policy's size; one warm-up update, then `updates` timed
ones. episodes_per_s is the timed updates' episodes over their summed `time/update` (sampling, scoring,
the reference/value/logprob forward, training, and with vllm the weight sync after the optimisation);
seconds_per_update splits it (means). peak_rss_mb is the process's peak. load_avg: the machine's 1- and
5-minute load averages when the configuration ended.

--modes requests: the sampling mode's 64 prompts x 64 tokens through one engine, by `generate` (the one-turn batch)
and by the request API (64 seeded requests submitted at once, stepped until all are back; hf: its slot decoder of
64 slots); batch_tokens_per_s, requests_tokens_per_s and their ratio (medians of `repeats` after a warm-up each); for hf
also transformers' own continuous batching (`model.generate_batch`) on the same prompts, which the hf engine does not use.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

SIZES = {"small": dict(hidden=128, layers=2, heads=2), "50m": dict(hidden=768, layers=9, heads=12)}
PROMPTS, NEW_TOKENS = 64, 64
PPO_EPISODES, PPO_RESPONSE = 32, 32  # per update; response tokens


def older(*places: str):
    """The first of "module:name" places that imports: the sampling mode also runs against an older tree's layout
    (PYTHONPATH=OLD_TREE/src, for before/after figures; ea351f4's modules were flat)."""
    import importlib

    for place in places:
        module, _, name = place.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {', '.join(places)} imports")


def demo_data(n_prompts: int):
    """-> (the demo's data with `n_prompts` prompts, its word-level tokenizer)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    make_data = older("ppokit.demos.reviews:make_data", "ppokit.demo:make_data")
    word_tokenizer = older("ppokit.demos.tiny:word_tokenizer", "ppokit.tiny:word_tokenizer")

    data = make_data(seed=0, n_sft=400, n_prompts=n_prompts, n_eval=4)
    return data, word_tokenizer(r["prompt"] + " " + r["completion"] for r in data["sft"])


def size_model(size: str, tokenizer):
    """A Llama of `size` (SIZES) for `tokenizer`, random weights drawn from seed 0."""
    import torch

    tiny_causal_lm = older("ppokit.demos.tiny:tiny_causal_lm", "ppokit.tiny:tiny_causal_lm")
    torch.manual_seed(0)
    return tiny_causal_lm("llama", tokenizer, max_positions=256, **SIZES[size])


def run_sampling(size: str, engine_name: str, repeats: int, enforce_eager: bool = True) -> dict:
    import torch

    from ppokit.engines.base import Sampling
    from ppokit.engines.hf import HFSampler

    left_pad = older("ppokit.models.forwards:left_pad", "ppokit.models.loading:left_pad", "ppokit.models:left_pad")
    data, tokenizer = demo_data(PROMPTS)
    model = size_model(size, tokenizer).eval()
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in data["prompts"]]
    pad = tokenizer.pad_token_id
    sync_s = None
    if engine_name == "hf":
        query_ids, query_mask = left_pad(prompts, pad)
        decode_step = None
        if not enforce_eager:  # the hf engine's rollout.enforce_eager: false
            from ppokit.engines.fast_decode import DecodeStep

            decode_step = DecodeStep()
        sampler = HFSampler(model, NEW_TOKENS, 1.0, None, pad, batch_size=PROMPTS, **({} if decode_step is None else {"decode_step": decode_step}))

        def generate():
            return sampler.sample(query_ids, query_mask).loss_mask.sum().item()
    else:
        from ppokit.engines.vllm import VLLMEngine

        engine = VLLMEngine(model, pad, max(map(len, prompts)) + NEW_TOKENS, max_num_seqs=PROMPTS)
        sampling = Sampling(NEW_TOKENS, 1.0, None)

        def generate():
            return engine.generate(prompts, sampling).loss_mask.sum().item()

        syncs = []
        for _ in range(repeats):
            start = time.perf_counter()
            engine.sync_weights(model)
            syncs.append(time.perf_counter() - start)
        sync_s = round(statistics.median(syncs), 3)
    start, start_cpu = time.perf_counter(), time.process_time()
    generate()  # warm-up (with enforce_eager false: the compiling too)
    warmup_s, warmup_cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    rates, cpu_rates = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        tokens = generate()
        rates.append(tokens / (time.perf_counter() - start))
        cpu_rates.append(tokens / (time.process_time() - start_cpu))
    params = sum(p.numel() for p in model.parameters())
    return dict(engine=engine_name, size=size, parameters=params, prompts=PROMPTS, new_tokens=NEW_TOKENS,
                tokens_per_s=round(statistics.median(rates), 1), best_tokens_per_s=round(max(rates), 1),
                tokens_per_cpu_s=round(statistics.median(cpu_rates), 1), warmup_s=round(warmup_s, 2), warmup_cpu_s=round(warmup_cpu_s, 2),
                **({} if enforce_eager else {"enforce_eager": False}), sync_s=sync_s,
                peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                threads=torch.get_num_threads())


def run_ppo(size: str, engine_name: str, updates: int) -> dict:
    import torch

    data, tokenizer = demo_data(PPO_EPISODES * (updates + 1))
    records, facts = ppo_records(lambda: size_model(size, tokenizer), tokenizer, data["prompts"], [f"rollout.engine={engine_name}"],
                                      updates=updates)
    return dict(benchmark="ppo_update", engine=engine_name, size=size, parameters=facts["parameters"], response_length=PPO_RESPONSE, ppo_epochs=1,
                **ppo_figures(records, PPO_EPISODES), peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                threads=torch.get_num_threads())


def ppo_config(model_dir: str, prompts_file: str, output_dir: str, overrides: list[str], *, updates: int,
               episodes: int = PPO_EPISODES, response_length: int = PPO_RESPONSE):
    """The benchmark's PPO config, validated: `episodes` per update (2 minibatches), 1 PPO epoch, `response_length`
    tokens without a stop token, VADER sentiment as the reward, updates + 1 updates (the first a warm-up), then
    `overrides` as on the command line (e.g. "rollout.engine=vllm", "bf16=true"). Nothing is read from disk."""
    from ppokit.config.schema import PPOConfig
    from ppokit.config.fields import load_config

    base = {
        "model": model_dir, "output_dir": output_dir, "seed": 0,
        "reward": {"functions": ["sentiment"]}, "data": {"train": prompts_file},
        "ppo": dict(total_episodes=episodes * (updates + 1), per_device_train_batch_size=episodes // 2, num_mini_batches=2,
                    num_ppo_epochs=1, response_length=response_length, temperature=1.0, learning_rate=1e-5, stop_token=None,
                    num_sample_generations=0),
    }
    return load_config(PPOConfig, None, overrides, data=base)


def ppo_records(build_model, tokenizer, prompts: list[dict], overrides: list[str], *, updates: int, watch=contextlib.nullcontext,
                **sizes) -> tuple[list[dict], dict]:
    """Train the model `build_model()` makes (saved, then dropped: the trainer loads its own) on `prompts` with
    `ppo_config(overrides, **sizes)` -> (the metric records of every update, {"parameters": the policy's count,
    "policy_dtype": its weights' dtype as the trainer loaded them}). `watch(run folder)`: a context manager around
    the training."""
    import tempfile
    from pathlib import Path

    import torch

    from ppokit.models.loading import no_progress_bars
    from ppokit.trainer import PPOTrainer

    with tempfile.TemporaryDirectory(prefix="ppokit-bench-") as tmp:
        work = Path(tmp)
        model = build_model()
        with no_progress_bars():
            model.save_pretrained(work / "model")
        tokenizer.save_pretrained(work / "model")
        parameters = sum(p.numel() for p in model.parameters())
        del model
        (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
        config = ppo_config(str(work / "model"), str(work / "prompts.jsonl"), str(work / "run"), overrides, updates=updates, **sizes)
        torch.manual_seed(0)
        trainer = PPOTrainer(config, show_progress=False)
        with watch(work / "run"):
            records = trainer.train()
    return records, {"parameters": parameters, "policy_dtype": str(next(trainer.policy.parameters()).dtype).removeprefix("torch.")}


def ppo_figures(records: list[dict], episodes: int) -> dict:
    """What a PPO benchmark line says of its updates of `episodes` episodes: the first is a warm-up; episodes/s and
    the mean seconds of each stage over the others; the engine-vs-trainer logprob difference (vllm) over all."""
    timed = records[1:]
    mean = lambda key: round(sum(r[key] for r in timed) / len(timed), 3)  # noqa: E731
    return dict(episodes_per_update=episodes, updates_timed=len(timed),
                episodes_per_s=round(episodes * len(timed) / sum(r["time/update"] for r in timed), 2),
                first_update_s=round(records[0]["time/update"], 2),
                seconds_per_update={"generation": mean("time/generation"), "scoring": mean("time/scoring"),
                                    "forward": mean("time/forward"), "training": mean("time/training"), "total": mean("time/update")},
                logprob_diff_max=max((r["rollout/logprob_diff_max"] for r in records if "rollout/logprob_diff_max" in r), default=None))


def run_requests(size: str, engine_name: str, repeats: int) -> dict:
    """The same 64 prompts x 64 tokens two ways through one engine: `generate` (the one-turn batch: hf's lock-step
    decoder, vLLM's queue) and the request API (64 seeded requests submitted at once, `step` until all are back:
    hf's slot decoder, vLLM's queue); tokens/s of each (median of `repeats`, after a warm-up of each)."""
    import torch

    from ppokit.engines.base import Request, Sampling, complete

    data, tokenizer = demo_data(PROMPTS)
    model = size_model(size, tokenizer).eval()
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in data["prompts"]]
    longest = max(map(len, prompts)) + NEW_TOKENS
    if engine_name == "hf":
        from ppokit.engines.hf import HFEngine

        engine = HFEngine(model, tokenizer.pad_token_id, torch.device("cpu"), rows_per_forward=PROMPTS, max_sequence=longest)
    else:
        from ppokit.engines.vllm import VLLMEngine

        engine = VLLMEngine(model, tokenizer.pad_token_id, longest, max_num_seqs=PROMPTS)
    sampling = Sampling(NEW_TOKENS, 1.0, None)
    calls = iter(range(10**6))

    def batch():
        return engine.generate(prompts, sampling).loss_mask.sum().item()

    def requests():
        call = next(calls)
        done = complete(engine, [Request(f"{call}-{i}", p, sampling, seed=call * PROMPTS + i) for i, p in enumerate(prompts)])
        return sum(len(c.token_ids) for c in done)

    runs = [("batch", batch), ("requests", requests)]
    if engine_name == "hf" and hasattr(model, "generate_batch"):
        runs.append(("transformers_continuous_batching", transformers_continuous_batching(model, tokenizer, prompts)))
    rates = {}
    for name, run in runs:
        run()  # warm-up
        timed = []
        for _ in range(repeats):
            start = time.perf_counter()
            tokens = run()
            timed.append(tokens / (time.perf_counter() - start))
        rates[name] = round(statistics.median(timed), 1)
    return dict(benchmark="requests", engine=engine_name, size=size, parameters=sum(p.numel() for p in model.parameters()),
                prompts=PROMPTS, new_tokens=NEW_TOKENS, batch_tokens_per_s=rates["batch"], requests_tokens_per_s=rates["requests"],
                requests_vs_batch=round(rates["requests"] / rates["batch"], 2),
                transformers_continuous_batching_tokens_per_s=rates.get("transformers_continuous_batching"),
                peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024), threads=torch.get_num_threads())


def transformers_continuous_batching(model, tokenizer, prompts):
    """transformers' own continuous batching (`model.generate_batch`, transformers >= 5) on the same prompts and
    sampling, for comparison (the hf engine does not use it: docs/rollout.md says why) -> a function returning the
    tokens it generated."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    generation = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS, eos_token_id=-1,
                                  pad_token_id=tokenizer.pad_token_id)
    # Its KV cache sized for the workload (a block of 256 tokens per request): left to itself on CPU it takes 90% of
    # the machine's free memory (14 GB peak RSS here for the 0.3M model).
    batching = ContinuousBatchingConfig(return_logprobs=True, seed=0, num_blocks=len(prompts) + 8, max_batch_tokens=2048)

    def run():
        out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching, progress_bar=False)
        return sum(len(o.generated_tokens) for o in out.values())

    return run


RUNS = {"sampling": run_sampling, "ppo": run_ppo, "requests": run_requests}



def one_case(script: str, argv: list[str], label: str) -> bool:
    """Runs `script --one *argv` in a fresh process (each case its own imports, threads and peak RSS) and prints
    its last JSON line; on failure, says so on stderr with the end of its stderr. True when it gave a line."""
    result = subprocess.run([sys.executable, script, "--one", *argv], capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode or not lines:
        print(f"{label} failed (exit {result.returncode}):\n{result.stderr[-3000:]}", file=sys.stderr)
        return False
    print(lines[-1], flush=True)
    return True

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,50m")
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--modes", default="sampling,ppo", help="sampling (tokens/s of the engine alone), ppo (a full PPO update "
                        "through the trainer), requests (generate against the request API), or several: sampling,ppo")
    parser.add_argument("--repeats", type=int, default=3, help="sampling: timed generates")
    parser.add_argument("--updates", type=int, default=2, help="ppo: timed updates, after one warm-up update")
    parser.add_argument("--no-enforce-eager", action="store_true", help="sampling, hf: the compiled decoding step (rollout.enforce_eager: "
                        "false, `engines.fast_decode`)")
    parser.add_argument("--one", nargs=3, metavar=("MODE", "SIZE", "ENGINE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        mode, size, engine = args.one
        extra = {"enforce_eager": False} if args.no_enforce_eager else {}
        result = RUNS[mode](size, engine, args.updates if mode == "ppo" else args.repeats, **extra)
        # the machine's load while it ran (1 and 5 minute averages, at the end): a shared machine's figures swing with it
        print(json.dumps({**result, "load_avg": [round(x, 1) for x in os.getloadavg()[:2]]}), flush=True)
        return
    for mode in args.modes.split(","):
        for size in args.sizes.split(","):
            for engine in args.engines.split(","):
                one_case(__file__, [mode, size, engine, "--repeats", str(args.repeats), "--updates", str(args.updates),
                                    *(["--no-enforce-eager"] if args.no_enforce_eager else [])],
                         f"rollout_engines: {mode} {size} {engine}")


if __name__ == "__main__":
    main()
