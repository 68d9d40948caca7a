"""Rollout engines for tests whose answers are scripted: the request half of ppokit.engines.base.RolloutEngine
(submit / step / unfinished / abort / forget / serving) over a function of each request, and `generate` through the
same requests (engines.base.generate). Every request submitted completes at the next step."""

from __future__ import annotations

import contextlib

from ppokit.engines.base import Sampled, generate


class ScriptedRequests:
    """Subclasses give `respond(request) -> (token ids, logprobs)`; the answer is cut to the request's max_new_tokens and
    ends with finish_reason "stop" where it holds its stop token. `submitted`: the prompts of each submit call."""

    logprobs_are_trainers = True
    pad_token_id = 0
    device = None

    def __init__(self):
        self.queue, self.submitted, self.requests = [], [], []

    def respond(self, request) -> tuple[list[int], list[float]]:
        raise NotImplementedError

    def submit(self, requests) -> None:
        requests = list(requests)
        self.queue += requests
        self.requests += requests
        self.submitted.append([list(r.prompt) for r in requests])

    def step(self) -> list[Sampled]:
        done, self.queue = self.queue, []
        return [self._complete(r) for r in done]

    def _complete(self, request) -> Sampled:
        ids, logprobs = self.respond(request)
        sampling = request.sampling
        ids, logprobs = list(ids)[: sampling.max_new_tokens], list(logprobs)[: sampling.max_new_tokens]
        end = next((i + 1 for i, token in enumerate(ids) if token in sampling.stop_token_ids), None)
        if end is not None:
            return Sampled(request.request_id, ids[:end], logprobs[:end], "stop")
        return Sampled(request.request_id, ids, logprobs, "length")

    def unfinished(self) -> int:
        return len(self.queue)

    def abort(self, request_ids) -> list[Sampled]:
        wanted = set(request_ids)
        aborted = [Sampled(r.request_id, [], [], "abort") for r in self.queue if r.request_id in wanted]
        self.queue = [r for r in self.queue if r.request_id not in wanted]
        return aborted

    def forget(self, request_ids) -> None:
        pass

    def serving(self):
        return contextlib.nullcontext()

    def generate(self, prompts, sampling):
        return generate(self, prompts, sampling, self.pad_token_id, self.device)

    def sync_weights(self, policy) -> None:
        """Nothing to sync, release, resume or close: the answers are scripted."""

    release = resume = close = lambda self: None
