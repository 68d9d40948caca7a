"""Where one training micro-batch's time goes, on `ppo_throughput.py`'s fixed shape; prints one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/micro_batch_cost.py [--repeats 15]

Trains the fixed task (tiny Llama, hidden 128, 4 layers, 64 episodes, 16-token responses, 4 epochs x 2 minibatches of
32 rows: one micro-batch per minibatch, 8 per update) for two updates, keeps the first micro-batch the optimisation
saw and its episodes, then times, in this process's CPU time (milliseconds, the median of `--repeats` after one
warm-up call), each part of stage 6 on them:

  micro_batch          `optimise.micro_batch_backward` whole: the policy's forward, loss and backward, then the critic's
  policy_forward       the policy's training forward alone (with gradient), `policy_forward_backward` with its backward
  critic_forward       the same for the critic
  loss                 `algo.ppo_loss` over the micro-batch's (detached) logprobs and values, forward and backward
  micro_batches        forming a minibatch's micro-batches (`optimise.micro_batches`)
  clip, step, zero     per optimiser step: the strategy's gradient clipping, the AdamW step, zero_grad(set_to_none)
  update_training      `optimise.ppo_epochs` whole (8 micro-batches and 8 optimiser steps)

and two alternatives, each alternated with the default call by call: `together` (both models' forwards, then one
backward of the summed loss, as under ddp) against `micro_batch`, and `eager_attention` (the models'
attn_implementation "eager" instead of "sdpa") against `micro_batch`; for each, the ratio of the medians and
whether the gradients are bit-for-bit the same. One process, 2 cores shared: read the ratios, alternated in the
same process, before the absolute figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import ppo_throughput  # noqa: E402

import ppokit.trainer as trainer_module  # noqa: E402
from ppokit.trainer import PPOTrainer  # noqa: E402
from ppokit.training import optimise  # noqa: E402


def first_micro_batch() -> tuple:
    """(the trained model pair, the micro-batch, the rest of micro_batch_backward's arguments) of one fixed-task update."""
    seen: dict = {}
    backward_of = optimise.micro_batch_backward

    def keep(model, mb, *rest):
        seen.setdefault("micro_batch", (model, copy.deepcopy(mb), *rest))
        return backward_of(model, mb, *rest)

    optimise.micro_batch_backward = keep
    try:
        with tempfile.TemporaryDirectory(prefix="ppokit-bench-") as tmp:
            config, _ = ppo_throughput.fixed_task(Path(tmp), 1, "llama")
            torch.manual_seed(0)
            PPOTrainer(config, show_progress=False).train()
    finally:
        optimise.micro_batch_backward = backward_of
    return seen["micro_batch"]


def in_turn(run, names, repeats: int) -> tuple[dict, dict, dict]:
    """run(name) -> the gradients of one micro-batch. Each variant called once (its first call: compile compiles there), then
    `repeats` rounds of every variant in turn -> (CPU seconds per call by name, the first call's CPU seconds by name, each
    variant's largest gradient gap relative to "default"'s largest entry)."""
    reference = run("default")
    gaps, first_call = {}, {}
    for name in names:
        started = time.process_time()
        run(name)
        first_call[name] = time.process_time() - started
        grads = run(name)
        gaps[name] = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() for a, b in zip(grads, reference) if b is not None)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            started = time.process_time()
            run(name)
            times[name].append(time.process_time() - started)
    return times, first_call, gaps


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.process_time()
        fn()
        times.append(time.process_time() - started)
    return round(sorted(times)[len(times) // 2] * 1000, 2)


def alternated(default, other, repeats: int) -> tuple[float, float, bool]:
    """(default ms, other ms, gradients equal): the two called in turn, each leaving its gradients, then cleared."""
    times: dict[str, list[float]] = {"default": [], "other": []}
    grads = {}
    for _ in range(repeats + 1):
        for name, fn in (("default", default), ("other", other)):
            started = time.process_time()
            grads[name] = fn()
            times[name].append(time.process_time() - started)
    ms = {k: round(sorted(v[1:])[len(v[1:]) // 2] * 1000, 2) for k, v in times.items()}
    return ms["default"], ms["other"], all(torch.equal(a, b) for a, b in zip(grads["default"], grads["other"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    seen: dict = {}
    backward_of, epochs_of = optimise.micro_batch_backward, trainer_module.ppo_epochs

    def keep_micro_batch(model, mb, *rest):
        seen.setdefault("micro_batch", (model, copy.deepcopy(mb), *rest))
        return backward_of(model, mb, *rest)

    def keep_episodes(model, optimizer, scheduler, episodes, *rest, **kwargs):
        seen.setdefault("episodes", episodes)
        return epochs_of(model, optimizer, scheduler, episodes, *rest, **kwargs)

    optimise.micro_batch_backward, trainer_module.ppo_epochs = keep_micro_batch, keep_episodes
    with tempfile.TemporaryDirectory(prefix="ppokit-bench-") as tmp:
        config, _ = ppo_throughput.fixed_task(Path(tmp), 1, "llama")
        torch.manual_seed(0)
        trainer = PPOTrainer(config, show_progress=False)
        trainer.train()
    optimise.micro_batch_backward, trainer_module.ppo_epochs = backward_of, epochs_of
    model, mb, hp, normalisers, scale, backward, separately = seen["micro_batch"]
    parts = trainer.parts
    inputs = (mb.input_ids, mb.attention_mask, mb.response_ids, mb.trained_mask, hp.temperature)

    def gradients() -> list[torch.Tensor]:
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        return grads

    def micro_batch(separate: bool = separately):
        backward_of(model, mb, hp, normalisers, scale, backward, separate)
        return gradients()

    def forward_backward(part: str):
        out = model(*inputs, part=part)
        (out[0] if part == "policy" else out[2]).sum().backward()
        model.zero_grad(set_to_none=True)

    logprobs, entropy, values = (t.detach() for t in model(*inputs))
    settings = optimise.loss_settings(hp)

    def loss():
        lp, v = logprobs.clone().requires_grad_(), values.clone().requires_grad_()
        optimise._ppo_loss(settings, normalisers, mb, lp, entropy, v).loss.backward()

    episodes, order = seen["episodes"], torch.randperm(len(seen["episodes"]))
    step_parts: dict[str, list[float]] = {"clip": [], "step": [], "zero": []}
    for _ in range(args.repeats):
        micro_batch()
        backward_of(model, mb, hp, normalisers, scale, backward, separately)
        for name, fn in (("clip", lambda: parts.strategy.clip_grad_norm_(model, hp.max_grad_norm)), ("step", parts.optimizer.step),
                         ("zero", lambda: parts.optimizer.zero_grad(set_to_none=True))):
            started = time.process_time()
            fn()
            step_parts[name].append(time.process_time() - started)
    result = {
        "benchmark": "micro_batch_cost", "rows_x_width": list(mb.input_ids.shape), "torch_threads": torch.get_num_threads(),
        "ms": {
            "micro_batch": median_ms(micro_batch, args.repeats),
            "policy_forward": median_ms(lambda: model(*inputs, part="policy"), args.repeats),
            "policy_forward_backward": median_ms(lambda: forward_backward("policy"), args.repeats),
            "critic_forward": median_ms(lambda: model(*inputs, part="value"), args.repeats),
            "critic_forward_backward": median_ms(lambda: forward_backward("value"), args.repeats),
            "loss": median_ms(loss, args.repeats),
            "micro_batches": median_ms(lambda: optimise.micro_batches(episodes, order[:32], parts.sizes, hp), args.repeats),
            **{k: round(sorted(v)[len(v) // 2] * 1000, 2) for k, v in step_parts.items()},
            "update_training": median_ms(lambda: optimise.ppo_epochs(model, parts.optimizer, parts.scheduler, episodes, hp, parts.sizes,
                                                                     parts.strategy, parts.reduce), max(args.repeats // 5, 1)),
        },
    }
    default_ms, together_ms, same = alternated(micro_batch, lambda: micro_batch(not separately), args.repeats)
    result["together"] = {"default_ms": default_ms, "ms": together_ms, "ratio": round(together_ms / default_ms, 3), "gradients_equal": same}

    own = [(m, m.config._attn_implementation) for m in (model.policy, model.value_model)]

    def eager_attention():
        for m, _ in own:
            m.set_attn_implementation("eager")
        try:
            return micro_batch()
        finally:
            for m, implementation in own:
                m.set_attn_implementation(implementation)
    default_ms, eager_ms, same = alternated(micro_batch, eager_attention, args.repeats)
    result["eager_attention"] = {"default_ms": default_ms, "ms": eager_ms, "ratio": round(eager_ms / default_ms, 3), "gradients_equal": same}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
