"""A tiny real model steered to write a scripted episode: a bias on the logit of the script's token at each position (a
random tiny model never writes a tool call). The bias is a function of the position alone (position_ids), so sampling
with a KV cache, either hf decoder, and a training forward all see the same model; where the script goes on past a stop
token, an engine that ignored the stop token would sample on into it. Used by tests/test_stop_tokens.py and
tests/test_tool_episodes.py."""

from __future__ import annotations

import functools

import torch


def scripted(episode: list[int], past_stops: dict[int, int]) -> dict[int, int]:
    """The script of `episode` (prompt and every turn and observation, as token ids): at position p, token p + 1; at the
    positions in `past_stops` (a stop token's), the token given there instead (what follows if the stop is ignored)."""
    script = {p: episode[p + 1] for p in range(len(episode) - 1)}
    script.update(past_stops)
    return script


def steer(model, script: dict[int, int], bias: float = 40.0):
    """`model` with `bias` added to the logit of token script[p] at every position p it lists (the same in sampling, with
    its KV cache, and in a training forward: a function of the position alone, as position_ids give it)."""
    base = type(model)

    @functools.wraps(base.forward)  # the model's own signature: callers read the name of its KV-cache keyword there
    def forward(self, input_ids=None, **kwargs):
        out = base.forward(self, input_ids=input_ids, **kwargs)
        logits, position_ids = out.logits, kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        positions = position_ids[:, -logits.shape[1]:]
        table = self.script_table.to(logits.device)
        wanted = torch.where(positions < len(table), table[positions.clamp(max=len(table) - 1)], -1)
        push = torch.zeros_like(logits).scatter_(-1, wanted.clamp(min=0).unsqueeze(-1), bias) * (wanted >= 0).unsqueeze(-1)
        out.logits = logits + push
        return out

    table = torch.full((max(script) + 1,), -1, dtype=torch.long)
    for position, token in script.items():
        table[position] = token
    model.__class__ = type(f"Steered{base.__name__}", (base,), {"forward": forward})
    model.script_table = table
    return model
