"""ppo.shared_prompt against the separate forwards: whole GRPO updates (stage 3 + stage 6) timed, alternating; prints JSON.

    python benchmarks/shared_prompt.py [--prompt 128] [--response 32] [--samples 8] [--groups 4] [--repeats 6]
    python benchmarks/shared_prompt.py --sweep [--repeats 4]        # prompt/response ratios x samples per prompt
    python benchmarks/shared_prompt.py --probe [--groups 4] [--samples 8] [--prompt 64] [--response 16] [--repeats 6]

Default: one GRPO run of a tiny Llama (hidden 128, 4 layers, word-level vocabulary, built here), prompts of exactly
--prompt tokens, --samples responses of exactly --response tokens each (no stop token), --groups prompts per update,
one PPO epoch of two minibatches (TRL's GRPO default: one iteration), a reference model (KL in the loss). One real
update samples the episodes; then, over those same episodes, the reference pass (`experience.reference_and_values`)
and the PPO epochs (`optimise.ppo_epochs`, the weights left unmoved: learning rate 0) are timed with the prompt
computed separately and shared, in turn (which goes first alternates), --repeats times each, one torch thread.
episodes/s: the update's episodes over the two stages' seconds (sampling and scoring, which the switch does not
touch, left out). The minimum is the figure least moved by other work on a shared machine; the median is printed too.

--probe: the mechanism alone, not the trainer: the backbone's forward and backward over one row per group (prompt,
then the n responses, a 4-D mask) against n rows, sdpa and eager.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ppokit.demos.tiny import tiny_config, word_tokenizer


def prefix_mask(prompt: int, response: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (allowed (W, W) bool, position_ids (W,)) of one row: the prompt, then `samples` responses."""
    positions = torch.cat([torch.arange(prompt), (prompt + torch.arange(response)).repeat(samples)])
    segment = torch.cat([torch.full((prompt,), -1), torch.arange(samples).repeat_interleave(response)])
    width = prompt + samples * response
    earlier = torch.arange(width).unsqueeze(1) >= torch.arange(width).unsqueeze(0)
    same_or_prompt = (segment.unsqueeze(0) == -1) | (segment.unsqueeze(0) == segment.unsqueeze(1))
    return earlier & same_or_prompt, positions


def probe(attention: str, groups: int, samples: int, prompt: int, response: int, repeats: int) -> dict:
    tokenizer = word_tokenizer(["a b c d e f g h i j k l m n o p q r s t u v w x y z"] * 3)
    config = tiny_config("llama", tokenizer, hidden=128, layers=4, heads=4, max_positions=prompt + response + 1)
    config._attn_implementation = attention
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    backbone = AutoModelForCausalLM.from_config(config).eval().model
    prompts = torch.randint(3, len(tokenizer), (groups, prompt))
    responses = torch.randint(3, len(tokenizer), (groups, samples, response))
    separate_ids = torch.cat([prompts.repeat_interleave(samples, 0), responses.reshape(groups * samples, response)], 1)
    shared_ids = torch.cat([prompts, responses.reshape(groups, samples * response)], 1)
    allowed, positions = prefix_mask(prompt, response, samples)
    mask = allowed[None, None].expand(groups, 1, *allowed.shape)
    if attention == "eager":  # eager adds its mask to the scores
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)

    def separate():
        return backbone(input_ids=separate_ids, position_ids=torch.arange(prompt + response).expand(groups * samples, -1)).last_hidden_state

    def shared():
        return backbone(input_ids=shared_ids, attention_mask=mask, position_ids=positions.expand(groups, -1)).last_hidden_state

    with torch.no_grad():
        apart = separate().reshape(groups, samples, prompt + response, -1)
        once = shared()
        gap = max((apart[:, :, prompt:] - once[:, prompt:].reshape(groups, samples, response, -1)).abs().max().item(),
                  (apart[:, 0, :prompt] - once[:, :prompt]).abs().max().item())
    times: dict[str, list[float]] = {"separate": [], "shared": []}
    for repeat in range(repeats):
        order = (("separate", separate), ("shared", shared))
        for name, forward in order if repeat % 2 == 0 else order[::-1]:
            backbone.zero_grad(set_to_none=True)
            start = time.perf_counter()
            forward().square().mean().backward()
            times[name].append(time.perf_counter() - start)
    return {"benchmark": "shared_prompt", "attention": attention, "groups": groups, "samples": samples, "prompt": prompt,
            "response": response, "largest_difference": gap,
            **{name: {"min_s": round(min(v), 4), "median_s": round(statistics.median(v), 4)} for name, v in times.items()},
            "speedup_min": round(min(times["separate"]) / min(times["shared"]), 2),
            "speedup_median": round(statistics.median(times["separate"]) / statistics.median(times["shared"]), 2)}


def update_timing(prompt: int, response: int, samples: int, groups: int, repeats: int) -> dict:
    from ppokit.config.schema import DataConfig, PPOConfig, PPOHyperparams, RewardConfig
    from ppokit.demos.tiny import tiny_causal_lm
    from ppokit.models.prefix import forward_layout
    from ppokit.trainer import PPOTrainer
    from ppokit.training import experience, optimise

    words = [f"w{i}" for i in range(200)]
    batch = groups * samples
    with tempfile.TemporaryDirectory(prefix="ppokit-bench-") as tmp:
        work = Path(tmp)
        tokenizer = word_tokenizer([" ".join(words)])
        torch.manual_seed(0)
        tiny_causal_lm("llama", tokenizer, hidden=128, layers=4, heads=4, max_positions=prompt + response + 8).save_pretrained(work / "model")
        tokenizer.save_pretrained(work / "model")
        generator = torch.Generator().manual_seed(0)
        rows = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (prompt,), generator=generator)) for _ in range(groups * 2)]
        (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
        config = PPOConfig(
            model=str(work / "model"), output_dir=str(work / "run"), reward=RewardConfig(functions=["sentiment"]),
            data=DataConfig(train=str(work / "prompts.jsonl")),
            ppo=PPOHyperparams(total_episodes=batch * 2, per_device_train_batch_size=batch // 2, num_mini_batches=2, num_ppo_epochs=1,
                               response_length=response, temperature=1.0, learning_rate=1e-4, num_sample_generations=0,
                               advantage_estimator="grpo", num_samples_per_prompt=samples, local_rollout_forward_batch_size=batch,
                               kl_loss_coef=0.04, shared_prompt=True),
        )
        trainer = PPOTrainer(config, show_progress=False)
        captured, optimise_once = [], trainer.optimise
        trainer.optimise = lambda rollout: captured.append(rollout) or optimise_once(rollout)
        trainer.step()
        episodes, model = captured[0], trainer.accelerator.unwrap_model(trainer.model)
        assert int(episodes.query_ids.ne(tokenizer.pad_token_id).sum(1).min()) >= prompt, "prompts shorter than --prompt"
        times: dict[bool, list[float]] = {False: [], True: []}
        for repeat in range(repeats):
            for shared in ((False, True) if repeat % 2 == 0 else (True, False)):
                hp = dataclasses.replace(config.ppo, shared_prompt=shared)
                model.padding_free = forward_layout(False, shared, samples)
                optimizer = torch.optim.SGD([p for p in trainer.model.parameters() if p.requires_grad], lr=0.0)
                scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
                start = time.perf_counter()
                experience.reference_and_values(episodes, model, trainer.parts.ref_model, rows=hp.local_rollout_forward_batch_size,
                                                packed=False, temperature=hp.temperature, chunk_size=None)
                optimise.ppo_epochs(trainer.model, optimizer, scheduler, episodes, hp, trainer.sizes, trainer.strategy, lambda t: t)
                times[shared].append(time.perf_counter() - start)
    result = {"benchmark": "shared_prompt", "mode": "update", "prompt": prompt, "response": response, "samples": samples, "groups": groups,
              "episodes": batch, "repeats": repeats, "load_average": [round(x, 2) for x in os.getloadavg()]}
    for name, side in (("separate", False), ("shared", True)):
        result[name] = {"min_s": round(min(times[side]), 4), "median_s": round(statistics.median(times[side]), 4),
                        "episodes_per_s": round(batch / min(times[side]), 2)}
    result["speedup_min"] = round(min(times[False]) / min(times[True]), 3)
    result["speedup_median"] = round(statistics.median(times[False]) / statistics.median(times[True]), 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--probe", action="store_true", help="the mechanism alone (the backbone), not the trainer")
    parser.add_argument("--sweep", action="store_true", help="prompt/response ratios 1/4 to 8 at --response, samples 2, 4 and 8")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.probe:
        for attention in ("sdpa", "eager"):
            print(json.dumps(probe(attention, args.groups, args.samples, args.prompt, args.response, args.repeats)), flush=True)
        return
    shapes = [(args.prompt, args.samples)]
    if args.sweep:
        shapes = [(int(args.response * ratio), samples) for samples in (2, 4, 8) for ratio in (0.25, 1, 4, 8)]
    for prompt, samples in shapes:
        groups = max(args.groups * args.samples // samples, 2)  # the same episodes per update
        print(json.dumps(update_timing(prompt, args.response, samples, groups, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
