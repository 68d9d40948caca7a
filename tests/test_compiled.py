"""`compile: true`: the compiled training forward equals eager; an unusable toolchain is one clear error."""

import os
import subprocess
import sys

import pytest
import torch

from ppokit.models.forwards import response_logprobs, response_values
from ppokit.models.loading import value_model_from_policy

SRC = os.path.join(os.path.dirname(__file__), os.pardir, "src")


def test_the_compiled_forward_is_in_place_for_the_call_only(model_dir):
    """`CompiledBackbone.in_place`: the backbone's own forward is back after the call (the class's, or one its instance
    carried), so the no-gradient passes and sampling, which call the same module, stay eager."""
    from transformers import AutoModelForCausalLM

    from ppokit.models.compiled import compiled_backbone

    policy = AutoModelForCausalLM.from_pretrained(model_dir("llama"))
    compiled = compiled_backbone(policy)
    with compiled.in_place():
        assert policy.model.forward is compiled.forward
    assert "forward" not in policy.model.__dict__
    own = policy.model.forward
    policy.model.forward = own  # an instance attribute, as a wrapper's hook sets
    with compiled.in_place():
        assert policy.model.forward is compiled.forward
    assert policy.model.__dict__["forward"] is own


@pytest.mark.slow
def test_compiled_training_forward_equals_eager(model_dir):
    """Logprobs, values and gradients of two micro-batch shapes (dynamic shapes: one compile)."""
    from transformers import AutoModelForCausalLM

    from ppokit.models.compiled import compiled_backbone

    policy = AutoModelForCausalLM.from_pretrained(model_dir("llama"))
    critic = value_model_from_policy(policy)
    torch.nn.init.normal_(critic.score.weight, std=0.1)
    policy_fn, critic_fn = compiled_backbone(policy), compiled_backbone(critic)
    g = torch.Generator().manual_seed(0)
    for rows, prompt, response in ((4, 5, 6), (3, 7, 4)):
        ids = torch.randint(4, policy.config.vocab_size, (rows, prompt + response), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :2] = 0  # left padding
        mask[1, -2:] = 0  # a short response
        response_ids, response_mask = ids[:, prompt:], mask[:, prompt:].bool()

        def run(policy_backbone, critic_backbone):
            lp, ent = response_logprobs(policy, ids, mask, response_ids, response_mask, 0.7, with_entropy=True,
                                        chunk_size=5, backbone_fn=policy_backbone)
            values = response_values(critic, ids, mask, response, backbone_fn=critic_backbone)
            loss = lp.sum() + (values * response_mask).pow(2).sum()
            params = [p for m in (policy, critic) for p in m.parameters()]
            return [lp.detach(), ent, values.detach(), *torch.autograd.grad(loss, params, allow_unused=True)]

        eager, compiled = run(None, None), run(policy_fn, critic_fn)
        for i, (a, b) in enumerate(zip(eager, compiled)):
            if a is not None:
                # Relative to the tensor's scale: inductor's kernels sum in another order than eager's, and a gradient
                # entry near zero in a tensor whose largest is ~35 differs by ~1e-5 (seen when other tests ran first).
                error, scale = (a - b).abs().max().item(), a.abs().max().item()
                assert error <= 1e-5 * scale + 1e-6, (i, rows, error, scale)


def test_compile_where_torch_compile_cannot_run_is_one_clear_error(tmp_path):
    """No C++ compiler for inductor's CPU kernels (a real failure, not a mock): a UserError saying so."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.path.abspath(SRC)}
    code = ("from ppokit.models.compiled import check_available\nfrom ppokit.errors import UserError\n"
            "try:\n    check_available()\nexcept UserError as e:\n    print(e)\nelse:\n    print('no error')\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert out.stdout.startswith("compile: true, but torch.compile cannot run on this machine (")
    assert "no-such-compiler" in out.stdout and "set compile: false" in out.stdout
