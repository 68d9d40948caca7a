"""Shared fixtures: tiny real tokenizers and models built locally (no hub), CPU only."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models run fastest on one thread, and a busy machine makes extra threads spin: one thread here and in
# every process a test starts (`ppokit ...` subprocesses), as the suite runs on two workers (pyproject addopts).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from ppokit.demos.reviews import make_data  # noqa: E402
from ppokit.demos.tiny import tiny_causal_lm, word_tokenizer  # noqa: E402


FLOAT32_EPS = torch.finfo(torch.float32).eps


def assert_float32_close(got: torch.Tensor, want: torch.Tensor, terms: int, ulps: float = 4.0, scale: float | None = None):
    """`got` and `want` are one float32 quantity computed two ways that differ only in kernels or summation
    order (another CPU's vector width, another chunking or batch shape). Each element comes out of reductions
    of at most `terms` terms no larger than `scale` (default: the largest |want|), so the two differ by a few
    ulps of `scale`, growing like sqrt(terms). A bug moves a result by far more than this bound."""
    scale = want.detach().abs().max().item() if scale is None else scale
    tol = ulps * FLOAT32_EPS * math.sqrt(terms) * max(scale, torch.finfo(torch.float32).tiny)
    diff = (got.detach().double() - want.detach().double()).abs().max().item()
    assert diff <= tol, f"differ by {diff:.3g} > {tol:.3g} ({ulps} ulps x sqrt({terms}) of {scale:.3g})"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def conversation_renderer(tokenizer, template, *, tools=None, template_kwargs=None, stop_token_ids=None, **keys):
    """A `ConversationRenderer` over `template` (None: plain-text prompts), its chat renderer and stop tokens made as the
    run's set-up makes them (`environments.conversation.conversation_setup`); keys: its other arguments (observation_role, say)."""
    from ppokit.conversation.templates import Renderer
    from ppokit.conversation.renderer import ConversationRenderer
    from ppokit.engines.base import stop_ids

    chat = Renderer(tokenizer, template, tools=tools, template_kwargs=template_kwargs) if template is not None else None
    return ConversationRenderer(tokenizer, chat, stop_token_ids=stop_ids(stop_token_ids), **keys)


@contextlib.contextmanager
def sigint_disposition(handler):
    """SIGINT handled by `handler` in this process while inside, then as before. Processes started inside inherit
    SIG_IGN as such, any other handler as the default action (Python's default_int_handler in a Python child)."""
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def sigint_handled():
    """SIGINT as in a terminal's foreground job, for tests that send it to this process or to processes they start: a
    shell starts background jobs (`pytest ... &`, nohup, CI wrappers) with SIGINT ignored, and children inherit that."""
    with sigint_disposition(signal.default_int_handler):
        yield


@pytest.fixture(scope="session")
def demo_data():
    return make_data(seed=0, n_sft=400, n_prompts=64, n_eval=4)


@pytest.fixture(scope="session")
def tokenizer(demo_data):
    return word_tokenizer(r["prompt"] + " " + r["completion"] for r in demo_data["sft"])


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer):
    """Save a tiny model of architecture `arch` with the tokenizer; returns its directory."""
    cache = {}

    def make(arch: str = "llama", **sizes) -> Path:
        key = (arch, tuple(sorted(sizes.items())))
        if key not in cache:
            torch.manual_seed(0)
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            tiny_causal_lm(arch, tokenizer, **sizes).save_pretrained(path)
            tokenizer.save_pretrained(path)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory, demo_data):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in demo_data["prompts"]))
    return path


def tiny_ppo_config(model_dir: Path, prompts_file: Path, output_dir: Path, **ppo):
    """A PPOConfig for a run of a few seconds on CPU."""
    from ppokit.config.schema import DataConfig, PPOConfig, PPOHyperparams, RewardConfig

    hp = dict(total_episodes=16, per_device_train_batch_size=4, num_mini_batches=2, num_ppo_epochs=2,
              response_length=8, temperature=1.0, learning_rate=1e-3, num_sample_generations=2)
    hp.update(ppo)
    return PPOConfig(
        model=str(model_dir), output_dir=str(output_dir), seed=1,
        reward=RewardConfig(functions=["sentiment"]), data=DataConfig(train=str(prompts_file)),
        ppo=PPOHyperparams(**hp),
    )


@pytest.fixture(scope="session")
def sft_model_dir(tmp_path_factory, tokenizer, demo_data):
    """The tiny llama after one short SFT epoch on the demo reviews (under a second): it ends its
    responses with EOS at varied lengths, as real policies do (random weights almost never stop)."""
    from ppokit.training.sft import encode_pair, train_sft

    torch.manual_seed(0)
    model = tiny_causal_lm("llama", tokenizer)
    examples = [encode_pair(tokenizer, r["prompt"], r["completion"]) for r in demo_data["sft"]]
    train_sft(model, examples, tokenizer.pad_token_id, epochs=1, batch_size=16, learning_rate=3e-3)
    path = tmp_path_factory.mktemp("tiny-sft")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def with_speed_switches(config, max_tokens_per_micro_batch=None, lm_head_chunk_size=None, compile=False):
    """`config` with the speed switches of docs/speed.md set (ppo.max_tokens_per_micro_batch, lm_head_chunk_size, compile)."""
    config.ppo.max_tokens_per_micro_batch = max_tokens_per_micro_batch
    config.lm_head_chunk_size = lm_head_chunk_size
    config.compile = compile
    return config


class LiveTensors:
    """A TorchDispatchMode that follows every tensor the ops inside it make (by storage, freed when the last
    tensor on it is) and keeps the peak of their bytes alive at once, and of those of at least
    `wide_elements` elements, their peak count. Tensors made before the mode (weights) are not counted."""

    def __new__(cls, wide_elements: int = 0):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        class Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.live: dict[int, list] = {}  # storage pointer -> [bytes, ids of the tensors on it]
                self.bytes = self.peak_bytes = self.peak_wide = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() == 0:
                        continue
                    key = t.untyped_storage().data_ptr()
                    if key not in self.live:
                        self.live[key] = [t.untyped_storage().nbytes(), set(), t.numel() >= wide_elements > 0]
                        self.bytes += self.live[key][0]
                    if id(t) not in self.live[key][1]:
                        self.live[key][1].add(id(t))
                        weakref.finalize(t, self._gone, key, id(t))
                self.peak_bytes = max(self.peak_bytes, self.bytes)
                self.peak_wide = max(self.peak_wide, sum(1 for v in self.live.values() if v[2]))
                return out

            def _gone(self, key, ident):
                entry = self.live.get(key)
                if entry is not None:
                    entry[1].discard(ident)
                    if not entry[1]:
                        self.bytes -= entry[0]
                        del self.live[key]

        return Mode()
