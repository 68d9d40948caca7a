"""`compile: true`: the training forward through torch.compile, and a clear error where it cannot run.

What is compiled: the backbone (embeddings, decoder layers, final norm) of the policy and of the value
model, as the training pass calls them. The output layer runs eagerly after it (through
`models.response_logprobs`, chunked when `lm_head_chunk_size` is set), and so do sampling (its KV cache
grows by one position a step: every step would be a new shape) and the no-gradient passes (one pass an
update does not repay a compile). The compiled callable wraps the module, it does not copy it: the
weights, their gradients and what a checkpoint saves are the module's own. Only the backbone's `forward` is
compiled, put in place of its own for the call (`CompiledBackbone`): the module's hooks run eagerly around it, and
under parallel.strategy fsdp the causal LM's own forward calls it (`models.forwards.from_hidden_states`), so that FSDP
gathers the root unit's weights (the embeddings and the head tied to them) as in an eager run.

Shapes vary every micro-batch (prompt and response widths, and the rows of a token budget), so the
backbone is compiled with dynamic shapes from the start instead of once per shape.
"""

from __future__ import annotations

import contextlib

import torch

from ppokit.errors import UserError
from ppokit.models.loading import backbone


def check_available(device: torch.device | str = "cpu", key: str = "compile: true", off: str = "compile: false") -> None:
    """Compile and run a two-operation function on `device`, or raise a UserError saying why not (for the config `key`,
    which `off` turns off).

    The reasons it fails are the machine's, not the model's: a Python version dynamo does not support,
    no C++ compiler for inductor's CPU kernels (CXX), no triton for CUDA kernels.
    """
    if not hasattr(torch, "compile"):
        raise UserError(f"{key} needs torch.compile (torch >= 2.0); this is torch {torch.__version__}")
    try:
        import torch._dynamo as dynamo

        dynamo.eval_frame.check_if_dynamo_supported()
        probe = torch.compile(lambda x: torch.tanh(x) * 2 + 1, dynamic=False)
        out = probe(torch.ones(3, device=device))
        expected = torch.tanh(torch.ones(3, device=device)) * 2 + 1
        if not torch.allclose(out, expected):
            raise RuntimeError("a compiled probe computed a wrong result")
    except Exception as e:  # noqa: BLE001 - any failure of the toolchain means the same to the user
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise UserError(f"{key}, but torch.compile cannot run on this machine ({type(e).__name__}: {first}); set {off}") from None


class CompiledBackbone:
    """A model's backbone with its `forward` compiled. Called (the backbone's signature: input_ids, attention_mask,
    position_ids, use_cache), it calls the module with the compiled forward in place of its own (`in_place`): the
    module's hooks (FSDP's gathering of a unit) run eagerly around the compiled code, as `torch.compile(module)` runs
    them. `in_place()` alone: the model's own forward calls the compiled backbone (a sharded causal LM's route)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.forward = torch.compile(module.forward, dynamic=True)

    def __call__(self, *args, **kwargs):
        with self.in_place():
            return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def in_place(self):
        own = self.module.__dict__.get("forward")  # a forward set on the instance (a wrapper's hook), compiled with the rest
        self.module.forward = self.forward  # an instance attribute, over the class's forward, for this call only
        try:
            yield
        finally:
            if own is None:
                del self.module.forward
            else:
                self.module.forward = own


def compiled_backbone(model) -> CompiledBackbone:
    """The compiled backbone of `model`; pass it as `backbone_fn` to `models.response_logprobs` /
    `models.response_values`."""
    return CompiledBackbone(backbone(model))
