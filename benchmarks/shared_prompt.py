"""The GRPO shape's shared prompt computed once: a probe of the mechanism, not of the trainer (issue 45 §2 is
not built yet); prints one JSON line per attention implementation.

    python benchmarks/shared_prompt.py [--groups 4] [--samples 8] [--prompt 64] [--response 16] [--repeats 6]

A group's n responses share one prompt. Computed separately, the prompt runs n times (n rows of prompt +
response). Computed once, one row holds the prompt and then the n responses, with a 4-D mask: a response
token attends to the prompt and to its own response's earlier tokens, never to the other responses, and its
positions continue from the prompt's, as in its own row. The probe checks that both give the same hidden
states (largest difference), then times the backbone's forward and backward (a scalar loss of its states) of
a tiny Llama (hidden 128, 4 layers), both ways in turn, one torch thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for attention in ("sdpa", "eager"):
        print(json.dumps(probe(attention, args.groups, args.samples, args.prompt, args.response, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
