"""The conversation renderer's cost per observation (ppokit.conversation.renderer): what the per-episode loop pays after every
model turn, for real chat templates (the originals trl ships, read from the installed package) with one tool's schema
in them. Prints one JSON line: microseconds per call, median of repeats.

    python benchmarks/conversation.py [--calls 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the template families (tests/chat_families.py)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from chat_families import FAMILIES

    from ppokit.conversation.templates import Renderer
    from ppokit.conversation.renderer import ConversationRenderer
    from ppokit.environments.tools import tool_schemas

    schemas = tool_schemas({"add": add})
    result = {"benchmark": "conversation", "calls": args.calls, "repeats": args.repeats}
    for name in ("qwen2_5", "qwen3", "llama3_1", "gptoss"):
        family = FAMILIES[name]
        tok = family.tokenizer()
        chat = Renderer(tok, tok.chat_template, tools=schemas, template_kwargs=family.template_kwargs)
        renderer = ConversationRenderer(tok, chat, stop_token_ids=(tok.convert_tokens_to_ids(family.stop),), observation_role="tool")
        renderer.check(needs_tools=True, max_turns=2)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for i in range(args.calls):
                renderer.observation([{"role": "tool", "name": "add", "content": str(i)}], str(i), True, room=512)
            times.append((time.perf_counter() - start) / args.calls)
        result[name] = {"us_per_observation": round(statistics.median(times) * 1e6, 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
