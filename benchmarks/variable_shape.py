"""The variable-shape task of `ppo_throughput.py --shape variable`, built locally and cached.

Real RLHF batches are not rectangular: prompts vary in length, most responses end early at a stop
token, and vocabularies are tens of thousands of tokens. This task has that shape on a CPU:

- a byte-level BPE tokenizer trained here to 32,000 tokens (on this Python's standard library
  sources, with the task's own texts),
- a Llama of about 11M parameters (hidden 256, 4 layers; most of it the 32k x 256 embedding, tied),
- prompts of 8-64 tokens: zero to five sentences of context before a review opener,
- an SFT'd policy that writes one to six review sentences and then the EOS token: responses of
  varied length, capped at 64 tokens.

Building it (tokenizer ~10 s, SFT ~2-4 min on 2 cores) happens once; the result is cached in
$PPOKIT_BENCH_CACHE (default ~/.cache/ppokit-bench) under a key of everything that shapes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

from ppokit.demos.reviews import NEGATIVE, NOUNS, OPENERS, POSITIVE, _review
from ppokit.training.sft import IGNORE_INDEX, collate, encode_pair, train_loop
from ppokit.demos.tiny import bpe_tokenizer, tiny_causal_lm

VERSION = 1
VOCAB = 32000
MODEL = dict(hidden=256, layers=4, heads=4, max_positions=256)
SFT = dict(rows=3000, steps=150, batch=16, lr=3e-3)
PROMPT_TOKENS = (8, 64)
RESPONSE_LENGTH = 64

TITLES = ["the long night", "a quiet river", "the last summer", "blue city", "the house on the hill", "northern lights",
          "the glass key", "a winter tale", "the hidden road", "paper moons", "the iron garden", "small hours"]
WHEN = ["last week", "on friday", "yesterday", "over the weekend", "on a rainy sunday", "after work", "on a long flight"]
WHO = ["my sister", "two friends", "my parents", "a colleague", "the whole family", "nobody", "my neighbour"]
WHERE = ["at the old cinema", "at home", "on a small laptop", "in a packed theatre", "at a festival", "on television"]
CONTEXT = [
    "i watched {title} {when} with {who} .",
    "we saw it {where} , {when} .",
    "it runs for about two hours and the poster promised a lot .",
    "the trailer made it look like a {adj} {noun} story .",
    "{who} had recommended it to me months ago .",
    "i had read the book first , so i knew how the {noun} ends .",
    "tickets were cheap {when} , so we went {where} .",
]


def _context(rng: random.Random) -> str:
    template = rng.choice(CONTEXT)
    return template.format(title=rng.choice(TITLES), when=rng.choice(WHEN), who=rng.choice(WHO), where=rng.choice(WHERE),
                           adj=rng.choice(POSITIVE + NEGATIVE), noun=rng.choice(NOUNS))


def make_prompt(rng: random.Random, min_context: int = 0) -> str:
    """`min_context` to 5 sentences of context, then a review opener (SFT rows use 0: an opener alone)."""
    return " ".join([_context(rng) for _ in range(rng.randint(min_context, 5))] + [rng.choice(OPENERS)])


def make_completion(rng: random.Random, positive: bool) -> str:
    words = POSITIVE if positive else NEGATIVE
    return " " + " ".join(_review(rng, words) for _ in range(rng.randint(1, 6)))


def _corpus(limit_chars: int = 12_000_000) -> list[str]:
    """This Python's standard library sources (sorted, tests left out): ~12 MB of code and English."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, size = [], 0
    for path in sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "tests" not in p.parts and "site-packages" not in p.parts):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        size += len(text)
        if size > limit_chars:
            break
    return texts


def cache_dir() -> Path:
    key = json.dumps({"v": VERSION, "vocab": VOCAB, "model": MODEL, "sft": SFT, "python": sys.version.split()[0],
                      "torch": torch.__version__.split("+")[0]}, sort_keys=True)
    root = Path(os.environ.get("PPOKIT_BENCH_CACHE", Path.home() / ".cache" / "ppokit-bench"))
    return root / f"variable-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _sft_loss(model, batch, pad_token_id):
    """Completion cross-entropy with logits only at the labelled positions (the vocabulary is large)."""
    from ppokit.models.forwards import hidden_states, output_head  # here: a tree without them can still run the cached task

    ids, mask, labels = collate(batch, pad_token_id)
    hidden = hidden_states(model, ids, mask)[:, :-1]
    target = labels[:, 1:]
    keep = target != IGNORE_INDEX
    logits = output_head(model)(hidden[keep]).float()
    return torch.nn.functional.cross_entropy(logits, target[keep])


def build(say=lambda m: print(m, file=sys.stderr)) -> Path:
    """The SFT'd policy and its tokenizer in cache_dir()/sft (built once), and the prompt generator's seed."""
    out = cache_dir()
    if (out / "sft" / "config.json").is_file():
        return out / "sft"
    start = time.perf_counter()
    rng = random.Random(0)
    rows = [(make_prompt(rng), make_completion(rng, i % 2 == 0)) for i in range(SFT["rows"])]
    tokenizer = bpe_tokenizer(_corpus() + [p + c for p, c in rows] * 3, vocab_size=VOCAB)
    say(f"variable-shape task: tokenizer of {len(tokenizer)} tokens in {time.perf_counter() - start:.0f}s")
    torch.manual_seed(0)
    model = tiny_causal_lm("llama", tokenizer, **MODEL)
    examples = [encode_pair(tokenizer, p, c) for p, c in rows]
    pad = tokenizer.pad_token_id
    steps_per_epoch = -(-len(examples) // SFT["batch"])
    losses = train_loop(model, examples, lambda m, b: _sft_loss(m, b, pad), epochs=SFT["steps"] / steps_per_epoch,
                        batch_size=SFT["batch"], learning_rate=SFT["lr"], seed=0,
                        on_step=lambda s, n, loss: say(f"  sft step {s}/{n} loss {loss:.2f}") if s % 25 == 0 else None)
    tmp = out / "sft.tmp"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out / "sft")
    say(f"variable-shape task: SFT loss {losses[0]:.2f} -> {sum(losses[-10:]) / 10:.2f} in {time.perf_counter() - start:.0f}s -> {out / 'sft'}")
    return out / "sft"


def write_prompts(path: Path, n: int, seed: int = 1) -> None:
    """PPO prompts: one to five context sentences and an opener, 8 to ~70 tokens (the run cuts them at 64)."""
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"prompt": make_prompt(rng, min_context=1)}) + "\n" for _ in range(n)))
