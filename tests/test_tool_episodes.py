"""Tool-call formats without a template of their own in trl's set (mistral's `[TOOL_CALLS]name[ARGS]{...}`, pythonic
`[name(a=1)]`), end to end through an episode: the trainer's own parts (conversation, hf engine, episode loop, rollout)
with plain-text prompts that describe the tool (environment_args.tool_schemas: none) and a tiny real model steered to
write a call in the format, then an answer (tests/steered.py). The call runs the tool, its result is what the model
reads next, the answer ends the episode, exactly the model's tokens are trained; a format name that does not match
what the model writes leaves the call unparsed and the episode ends after one turn (the test fails if the parser is
not the one named)."""

from __future__ import annotations

import json

import pytest
import torch
from chat_families import ADD, byte_tokenizer
from steered import scripted, steer

from ppokit.demos.tiny import tiny_causal_lm

pytestmark = pytest.mark.transformers_pins  # CI runs this file under vLLM's transformers pin too (.ci/vllm-env)


CALLS = {
    "mistral": '[TOOL_CALLS]add[ARGS]{"a": 17, "b": 25}',
    "pythonic": "[add(a=17, b=25)]",
}


@pytest.mark.parametrize("parser", sorted(CALLS))
def test_a_call_in_the_named_format_runs_the_tool_through_an_episode(parser, tmp_path):
    from ppokit.config.schema import DataConfig, PPOConfig, PPOHyperparams, RewardConfig, RolloutConfig
    from ppokit.trainer import PPOTrainer

    # mistral's call markers are special tokens of its tokenizer: the turn reaches the parser with them kept
    tok = byte_tokenizer(["</s>", "<pad>", "[TOOL_CALLS]", "[ARGS]"], eos="</s>", pad="<pad>")
    eos = tok.eos_token_id
    (tmp_path / "arith.py").write_text(ADD)
    question = "You can call add(a, b). What is 17 + 25?"
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": question}) + "\n")
    config = PPOConfig(output_dir=str(tmp_path / "run"), reward=RewardConfig(functions=[]), data=DataConfig(train=str(tmp_path / "data.jsonl")),
                       environment="ppokit.environments:Tools",
                       environment_args={"tools": [f"{tmp_path}/arith.py:add"], "tool_schemas": "none", "tool_parser": parser},
                       rollout=RolloutConfig(max_turns=3),
                       ppo=PPOHyperparams(total_episodes=2, per_device_train_batch_size=2, num_mini_batches=1, response_length=48,
                                          num_sample_generations=0, advantage_estimator="grpo", num_samples_per_prompt=2))
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = encode(question)
    call = encode(CALLS[parser]) + [eos]
    observation = encode("<tool_response>\n42\n</tool_response>")  # plain-text prompts: the observation's text as it is
    answer = encode("It is 42.") + [eos]
    onward = encode(" and more")
    episode = prompt + call + observation + answer + onward
    script = scripted(episode, {len(prompt) + len(call) - 1: onward[0]})
    torch.manual_seed(0)
    model = steer(tiny_causal_lm("llama", tok, hidden=32, heads=2, max_positions=1024), script)

    seen = []

    def looks(prompts, completions, completion_ids, **columns):  # what a reward function receives (docs/environments.md)
        seen.append((list(completions), [list(ids) for ids in completion_ids]))
        return [0.0] * len(completions)

    trainer = PPOTrainer(config, model=model, tokenizer=tok, show_progress=False, reward_functions=[looks])
    prompts, columns = trainer.train_data.rows([0, 0])
    episodes = trainer.rollout.sample([prompt, prompt], prompts, columns)
    for row in range(2):
        trained = episodes.response_ids[row][episodes.loss_mask[row]].tolist()
        real = episodes.response_ids[row][episodes.attention_mask[row, len(prompt):]].tolist()
        assert real == call + observation + answer and trained == call + answer, tok.decode(real)
    assert episodes.turns.tolist() == [2, 2] and episodes.done.tolist() == [True, True]
    assert [t["text"] for t in episodes.transcripts[0] if t["role"] == "tool"] == ["<tool_response>\n42\n</tool_response>"]
    records = trainer.train()
    assert records[0]["rollout/turns"] == 2
    # completions: every turn and observation decoded without special tokens (mistral's [TOOL_CALLS] and the stop tokens
    # gone); completion_ids: the model's tokens as sampled, the episode's last stop token left out
    completions, ids = seen[-1]
    assert completions == [tok.decode(call + observation + answer, skip_special_tokens=True)] * 2
    assert ids == [call + answer[:-1]] * 2
    assert "[TOOL_CALLS]" not in completions[0] and ("17" in completions[0] and "25" in completions[0] and "42" in completions[0])
