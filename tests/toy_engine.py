"""A third rollout engine, for tests/test_engines.py::test_a_third_engine_is_one_module_and_one_entry: copied into a
copy of the package as ppokit/engines/toy.py, with one entry in ppokit.engines.ENGINES, and nothing else edited.

It samples with the hf engine's sampler and reports every logprob `rollout.toy_logprob_shift` too low (its own key), as
an engine with other kernels might; it says it holds `rollout.toy_held_bytes` of its own, for `ppokit plan`."""

from __future__ import annotations

from dataclasses import replace

from ppokit.engines.base import EngineMemory, EngineSetup, EngineSizing, Sampling, generate
from ppokit.engines.hf import HFEngine

ENTRY = '''    "toy": Engine(
        "ppokit.engines.toy:ToyEngine",
        "the hf sampler reporting its logprobs shifted (a test's engine)",
        keys=(
            ("toy_logprob_shift", float, doc(0.0, "subtracted from every sampled logprob.", check=rule(">= 0", lambda v: v >= 0))),
            ("toy_held_bytes", int, doc(0, "what the engine says it holds, for ppokit plan.", resume=True)),
        ),
    ),
'''


class ToyEngine:
    logprobs_are_trainers = False

    def __init__(self, setup: EngineSetup):
        self.hf = HFEngine.create(setup)
        self.shift = setup.settings.toy_logprob_shift
        self.calls = 0

    @classmethod
    def create(cls, setup: EngineSetup) -> "ToyEngine":
        return cls(setup)

    @staticmethod
    def memory(sizing: EngineSizing) -> EngineMemory:
        return EngineMemory(held=sizing.settings.toy_held_bytes, what="rollout engine (toy)")

    @staticmethod
    def check_installed() -> None:
        """Nothing to install."""

    @staticmethod
    def check(model_config, settings) -> None:
        """Any model, any of its keys."""

    def generate(self, prompts: list[list[int]], sampling: Sampling):
        return generate(self, prompts, sampling, self.hf.pad_token_id, self.hf.device)  # through its requests below

    def sync_weights(self, policy) -> None:
        pass

    def release(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def close(self) -> None:
        pass

    # requests: the hf engine's, their logprobs shifted; `calls` counts the submits (a one-turn rollout is one)
    def submit(self, requests) -> None:
        self.calls += 1
        self.hf.submit(requests)

    def step(self):
        return [replace(c, logprobs=[lp - self.shift for lp in c.logprobs]) for c in self.hf.step()]

    def unfinished(self) -> int:
        return self.hf.unfinished()

    def abort(self, request_ids):
        return self.hf.abort(request_ids)

    def forget(self, request_ids) -> None:
        self.hf.forget(request_ids)

    def serving(self):
        return self.hf.serving()
