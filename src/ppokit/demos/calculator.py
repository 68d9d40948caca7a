"""The tool demo: a tiny model learns to use a calculator (`ppokit demo --environment calculator`).

1. arithmetic questions ("what is 37 + 48 ?": two two-digit numbers added or subtracted, or one multiplied by a
   digit) and the transcripts of a player who calls the calculator tool for some of them, in the Hermes form
   (`<tool_call> {"name": "calculator", "arguments": {...}} </tool_call>`), and copies its result into the answer,
   sometimes writes a call the tool refuses (then answers without it), and answers the others in its head;
2. a word-level tokenizer that splits at spaces only and writes numbers digit by digit (`ppokit.demos.tiny.spaced_tokenizer`),
   so that every call the model can write is text the tool-call parser reads as JSON and the model copies numbers a digit
   at a time, with a chat template of its own that lists the tools in the prompt; a tiny Llama;
3. SFT on the transcripts, the player's turns only: the model learns both ways of answering and the call's
   format, not the arithmetic (a model this small cannot do these sums in its head);
4. PPO with the built-in Tools environment (`ppokit.environments:Tools`, with `calculator` as its one tool) and a
   reward for the right answer (`right_answer`). Calling the tool is what pays, so the share of right answers and
   the share of episodes with a valid call (`valid_call`, logged, weight 0: a measure, not a reward) rise.

`ppokit demo --environment calculator-agent` is the same task with step 4 made by an agent program instead of the
Tools environment: `solve`, a tool loop written with the `openai` package against the endpoint ppokit serves each
episode (`agent: ppokit.demos.calculator:solve`, docs/agents.md), which returns the reward itself.
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path
from typing import Optional

from ppokit.demos.reviews import (
    DemoChoice,
    demo_folder,
    demo_start,
    estimator_settings,
    first_and_last,
    model_heads,
    resume_ppo,
    sft_tiny_model,
    start_demo_folder,
    start_ppo,
    write_jsonl,
)

DEFAULT_ESTIMATOR = "gae"
TOOL = "ppokit.demos.calculator:calculator"
OPS = ("+", "-", "*")
MAX_TURNS = 3  # a call, the answer; or a refused call, another call, the answer
PLAYER = {"tool": 0.5, "refused": 0.15, "head": 0.35}  # how the SFT player answers: with the tool, after a refused call, in its head

# The template: the tools by name and arguments, one line per message, each closed by the stop token; words are
# separated by spaces wherever the tokenizer must split them (`ppokit.demos.tiny.spaced_tokenizer`).
CHAT_TEMPLATE = (
    "{%- if tools %}tools : {% for tool in tools %}{{ tool.function.name }} ( {{ tool.function.parameters.properties | join(' , ') }} ) "
    "{% endfor %}\n{% endif %}"
    "{%- for message in messages %}<|{{ message.role }}|> {{ message.content }}<eos>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|> {% endif %}"
)

SETTINGS = {
    # quick: about 150 s of CPU (most of it the SFT), measured on a loaded machine; full: a larger model, more data and more updates.
    True: dict(hidden=64, layers=2, n_sft=3000, sft_epochs=15, n_prompts=1024, n_eval=16, total_episodes=1024, batch=32, lr=3e-4),
    False: dict(hidden=128, layers=4, n_sft=6000, sft_epochs=6, n_prompts=4096, n_eval=32, total_episodes=4096, batch=64, lr=3e-4),
}


def calculator(a: int, op: str, b: int) -> int:
    """Work out a op b.

    Args:
        a: the first number
        op: the operation, one of +, - and *
        b: the second number
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {' '.join(OPS)}")
    return a + b if op == "+" else a - b if op == "-" else a * b


def question(rng: random.Random) -> dict:
    """A question {"messages": [the user's], "a", "op", "b", "answer"}: a + b or a - b of two-digit numbers, a * b by a digit."""
    op = rng.choice(OPS)
    a, b = rng.randint(10, 99), (rng.randint(2, 9) if op == "*" else rng.randint(10, 99))
    return {"messages": [{"role": "user", "content": f"what is {a} {op} {b} ?"}], "a": a, "op": op, "b": b,
            "answer": calculator(a, op, b)}


def solve(row: dict, base_url: str) -> dict:
    """The calculator task as an agent program (`agent: ppokit.demos.calculator:solve`): an `openai` tool loop of at most
    MAX_TURNS calls that runs the calculator on each call the model makes (its answer, or the error the Tools environment
    would give, so that the model reads the same words) -> the reward, 1 for the right answer, and whether a call ran
    (`agent/valid_call`)."""
    import json

    from openai import BadRequestError, OpenAI

    from ppokit.environments.tools import ToolCall, run_tool, tool_schemas

    client = OpenAI(base_url=base_url, api_key="demo", max_retries=0)
    messages, valid = list(row["messages"]), 0.0
    message = None
    for _ in range(MAX_TURNS):
        try:
            message = client.chat.completions.create(model="policy", messages=messages, tools=tool_schemas({"calculator": calculator})).choices[0].message
        except BadRequestError:  # the episode's token budget is spent: it ends where it is
            break
        messages.append(message)
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = run_tool({"calculator": calculator}, ToolCall(call.function.name, json.loads(call.function.arguments)), None)
            valid = max(valid, float(not result.startswith("error")))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    found = re.findall(r"the answer is (-?\d+)", (message.content or "") if message is not None else "")
    return {"reward": float(bool(found) and int(found[-1]) == int(row["answer"])), "valid_call": valid}


def call_text(arguments: dict) -> str:
    """A Hermes tool call of the calculator as the model writes it: JSON with a space between every token."""
    inner = " , ".join(f'"{key}" : {value if isinstance(value, int) else chr(34) + value + chr(34)}' for key, value in arguments.items())
    return f'<tool_call> {{ "name" : "calculator" , "arguments" : {{ {inner} }} }} </tool_call>'


def answer_text(number: int) -> str:
    return f"the answer is {number} ."


REFUSED_CALLS = (  # calls the player gets wrong, each one the tool refuses with an error the model reads
    lambda q: {"x": q["a"], "op": q["op"], "b": q["b"]},  # an argument the tool does not have
    lambda q: {"a": q["a"], "b": q["b"]},  # a missing argument
    lambda q: {"a": q["a"], "op": q["op"]},
    lambda q: {"a": q["a"], "op": "/", "b": q["b"]},  # an operation it does not know
)


def transcript(q: dict, rng: random.Random) -> list[dict]:
    """The SFT player's conversation for question q (after the user's message): with the tool (a call, its result,
    the answer copied from it), after a refused call (the tool's error, then the answer without it), or in its head."""
    from ppokit.environments.tools import ToolCall, run_tool

    way = rng.choices(list(PLAYER), weights=list(PLAYER.values()))[0]
    if way == "head":
        return [{"role": "assistant", "content": answer_text(q["answer"])}]
    arguments = {"a": q["a"], "op": q["op"], "b": q["b"]} if way == "tool" else rng.choice(REFUSED_CALLS)(q)
    result = run_tool({"calculator": calculator}, ToolCall("calculator", arguments), None)
    return [{"role": "assistant", "content": call_text(arguments)}, {"role": "tool", "name": "calculator", "content": result},
            {"role": "assistant", "content": answer_text(q["answer"])}]


def right_answer(prompts, completions, answer, **columns) -> list[float]:
    """1 where the episode's last `the answer is N` gives the row's `answer`, else 0 (the demo's reward)."""
    found = [re.findall(r"the answer is (-?\d+)", completion) for completion in completions]
    return [float(bool(numbers) and int(numbers[-1]) == int(expected)) for numbers, expected in zip(found, answer)]


def valid_call(prompts, completions, **columns) -> list[float]:
    """1 where the episode called the tool and it answered with a number (not an error), else 0 (a measure, weight 0)."""
    return [float(bool(re.search(r"</tool_call> <\|tool\|> -?\d+ ", completion + " "))) for completion in completions]


def sft_examples(tokenizer, conversations: list[list[dict]], tools: list[dict]) -> list[tuple[list[int], list[int]]]:
    """One example per conversation, rendered by the chat template with the tools as the run renders it: the prompt
    (with its generation prompt) read, each assistant turn and its stop token trained, each tool message and the
    next generation prompt read."""
    from ppokit.training.sft import IGNORE_INDEX

    def render(messages: list[dict], generation: bool) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    examples = []
    for messages in conversations:
        ids, labels = [], []
        for k, message in enumerate(messages):
            if message["role"] == "assistant":
                upto = render(messages[: k + 1], False)
                turn = upto[len(ids):]
                turn = turn[: turn.index(tokenizer.eos_token_id) + 1]  # the content and its stop token: what the model writes
                ids, labels = ids + turn, labels + turn
            elif k + 1 < len(messages) and messages[k + 1]["role"] == "assistant":  # what is read before the next turn
                upto = render(messages[: k + 1], True)
                ids, labels = ids + upto[len(ids):], labels + [IGNORE_INDEX] * (len(upto) - len(ids))
        examples.append((ids, labels))
    return examples


def chat_texts(conversations: list[list[dict]], tools: list[dict]) -> list[str]:
    """What the tokenizer's words are taken from: the SFT conversations as the chat template renders them (the tools'
    line, the role markers, the calls and the tool's errors), and the errors the Tools environment answers calls it
    cannot read with (`tool_errors`), so that the model reads those too and not the unknown token."""
    from ppokit.demos.tiny import spaced_tokenizer

    renderer = spaced_tokenizer([])  # any tokenizer renders a template: the text is what counts
    renderer.chat_template = CHAT_TEMPLATE
    # the stop token is split out of the text by the tokenizer: "?<eos>" holds the word "?"
    return [*(renderer.apply_chat_template(c, tools=tools, tokenize=False).replace("<eos>", " ") for c in conversations),
            *tool_errors()]


def tool_errors() -> list[str]:
    """What the Tools environment answers to calls it cannot run, as it says them: a call left open, one that is not
    JSON (each word of a call left out in turn: every message of the JSON decoder), one with text after its JSON, an
    unknown tool, arguments that are not an object, a wrong argument."""
    from ppokit.environments.tools import Tools

    tools = Tools(tools=[TOOL], tool_parser="hermes")
    words = call_text({"a": 37, "op": "+", "b": 48}).split()
    turns = ['<tool_call> { "name" : "calculator"', '<tool_call> { } x </tool_call>',
             '<tool_call> { "name" : "add" } </tool_call>', '<tool_call> { "name" : "calculator" , "arguments" : 1 } </tool_call>',
             '<tool_call> { "name" : "calculator" , "arguments" : { "c" : 1 } } </tool_call>',
             *(" ".join(words[:i] + words[i + 1:]) for i in range(1, len(words) - 1))]
    return [tools.step(turn)[0] for turn in turns]


def prepare_calculator_demo(out: Path, quick: bool, seed: int, say, engine: str = "hf") -> Path:
    """Steps 1-3: questions, the player's transcripts, a tokenizer with the chat template, a tiny model fine-tuned on
    them, in out/sft."""
    from ppokit.environments.tools import tool_schemas
    from ppokit.demos.tiny import spaced_tokenizer

    s = SETTINGS[quick]
    start_demo_folder(out, seed)
    rng = random.Random(seed)
    sft = [question(rng) for _ in range(s["n_sft"])]
    conversations = [q["messages"] + transcript(q, rng) for q in sft]
    columns = lambda q: {"messages": q["messages"], "answer": q["answer"]}  # noqa: E731
    write_jsonl(out / "data" / "sft.jsonl", [{"messages": c} for c in conversations])
    write_jsonl(out / "data" / "prompts.jsonl", [columns(question(rng)) for _ in range(s["n_prompts"])])
    write_jsonl(out / "data" / "eval_prompts.jsonl", [columns(question(rng)) for _ in range(s["n_eval"])])
    ways = {way: sum(1 for c in conversations if _way(c) == way) / len(conversations) for way in PLAYER}
    say(f"[1/4] data: {len(sft)} questions answered by a player who calls the calculator ({ways['tool']:.0%}), writes a call it "
        f"refuses ({ways['refused']:.0%}) or answers in its head ({ways['head']:.0%}); {s['n_prompts']} PPO questions -> {out / 'data'}")

    tools = tool_schemas({"calculator": calculator})
    tokenizer = spaced_tokenizer(chat_texts(conversations, tools))
    tokenizer.chat_template = CHAT_TEMPLATE
    sft_tiny_model(out, tokenizer, lambda: sft_examples(tokenizer, conversations, tools), s, seed, say, " on the transcripts",
                   heads=model_heads(s["hidden"], engine))
    return out


def _way(conversation: list[dict]) -> str:
    if len(conversation) == 2:
        return "head"
    return "refused" if conversation[2]["content"].startswith("error") else "tool"


def calculator_config(base: Path, out: Path, quick: bool, seed: int, estimator: dict, engine: str = "hf", agent: bool = False):
    from ppokit.config.schema import DataConfig, PPOConfig, PPOHyperparams, RewardConfig, RolloutConfig

    s = SETTINGS[quick]
    if agent:  # the agent program makes the episodes and returns the reward (right answer; valid_call logged as agent/valid_call)
        episodes = dict(agent="ppokit.demos.calculator:solve", agent_tool_parser="hermes", reward=RewardConfig(functions=[], on_error="skip"))
    else:
        episodes = dict(environment="ppokit.environments:Tools",
                        environment_args={"tools": [TOOL], "tool_parser": "hermes"},  # the template lists the tools, it shows no call format
                        reward=RewardConfig(functions=["ppokit.demos.calculator:right_answer", "ppokit.demos.calculator:valid_call"],
                                            weights=[1.0, 0.0, 1.0]))  # right_answer; valid_call a measure only; the environment (always 0)
    return PPOConfig(
        model=str(base / "sft"),
        output_dir=str(out / "ppo"),
        seed=seed,
        rollout=RolloutConfig(engine=engine, max_turns=MAX_TURNS, max_episode_tokens=64),
        **episodes,
        data=DataConfig(train=str(base / "data" / "prompts.jsonl"), eval=str(base / "data" / "eval_prompts.jsonl")),
        ppo=PPOHyperparams(
            total_episodes=s["total_episodes"], per_device_train_batch_size=s["batch"] // 2, gradient_accumulation_steps=1,
            num_mini_batches=2, num_ppo_epochs=4, response_length=28, temperature=1.0, learning_rate=s["lr"], kl_coef=0.01,
            num_sample_generations=4, num_eval_samples=s["n_eval"], **estimator,
        ),
    )


def run_calculator_agent_demo(output_dir: str | Path | None = None, **keys) -> dict:
    """`run_calculator_demo` with step 4 made by the agent program `solve` (`ppokit demo --environment calculator-agent`)."""
    import importlib.util

    from ppokit.errors import UserError

    if importlib.util.find_spec("openai") is None:  # said before any work, not as every episode's failure after the SFT
        raise UserError("demo --environment calculator-agent: its agent is written with the openai package; pip install openai")
    return run_calculator_demo(output_dir, agent=True, **keys)


def run_calculator_demo(output_dir: str | Path | None = None, quick: bool = False, seed: int = 0, show_progress: bool = True,
                        estimator: Optional[str] = None, prepared: str | Path | None = None, overwrite: bool = False,
                        engine: str = "hf", resume: bool = False, agent: bool = False) -> dict:
    """Steps 1-4 (the arguments as `ppokit.demos.reviews.run_demo`'s; estimator None: DEFAULT_ESTIMATOR; agent: step 4 by the
    agent program `solve`); returns the first and last share of right answers and of episodes with a valid call."""
    choice = DemoChoice.of("calculator-agent" if agent else "calculator", quick, seed, estimator, engine)
    out = demo_folder(choice, output_dir, overwrite, resume)
    start = time.perf_counter()
    base, say = demo_start(choice, out, prepared, resume, show_progress,
                           lambda out, say: prepare_calculator_demo(out, quick, seed, say, engine))
    config = calculator_config(base, out, quick, seed, estimator_settings(choice.estimator), engine, agent)
    trainer = start_ppo(config, show_progress, overwrite)
    say(f"[4/4] PPO ({choice.estimator}, rollout.engine {engine}): {trainer.sizes.num_updates} updates of {trainer.sizes.batch} "
        f"questions, up to {MAX_TURNS} turns each; reward: 1 for the right answer")
    if resume:
        resume_ppo(trainer, say)
    records = trainer.train()
    measures = dict(accuracy="reward/agent", valid_calls="agent/valid_call") if agent else dict(accuracy="reward/right_answer", valid_calls="reward/valid_call")
    window, summary = first_and_last(records, **measures, turns="rollout/turns")
    summary = {
        **summary, "environment": choice.environment, "estimator": choice.estimator, "engine": engine, "updates": len(records),
        "seconds": round(time.perf_counter() - start, 1), "output_dir": str(out),
    }
    say(f"\nright answers {summary['accuracy_start']:.0%} -> {summary['accuracy_end']:.0%}, episodes with a valid calculator call "
        f"{summary['valid_calls_start']:.0%} -> {summary['valid_calls_end']:.0%}, mean turns {summary['turns_start']:.2f} -> "
        f"{summary['turns_end']:.2f} (means over the first and last {window} updates), {summary['seconds']:.0f}s. "
        f"Run directory: {out / 'ppo'}")
    return summary
