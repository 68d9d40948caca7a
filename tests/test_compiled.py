"""`compile: true`: the compiled training forward equals eager; an unusable toolchain is one clear error."""

import copy
import os
import subprocess
import sys

import pytest
import torch

from ppokit.models import onednn
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
@pytest.mark.parametrize("backend", ["aten", "onednn"])
def test_compiled_training_forward_equals_eager(model_dir, backend):
    """Logprobs, values and gradients of two micro-batch shapes (dynamic shapes: one compile), against eager aten; with
    matmul_backend onednn the compiled backbone's Linears (forward and backward) are oneDNN's operator."""
    from transformers import AutoModelForCausalLM

    from ppokit.models.compiled import compiled_backbone

    policy = AutoModelForCausalLM.from_pretrained(model_dir("llama"))
    critic = value_model_from_policy(policy)
    torch.nn.init.normal_(critic.score.weight, std=0.1)
    eager_policy, eager_critic = copy.deepcopy(policy), copy.deepcopy(critic)
    if backend == "onednn":
        onednn.route_linears(policy), onednn.route_linears(critic)
    policy_fn, critic_fn = compiled_backbone(policy), compiled_backbone(critic)
    g = torch.Generator().manual_seed(0)
    for rows, prompt, response in ((4, 5, 6), (3, 7, 4)):
        ids = torch.randint(4, policy.config.vocab_size, (rows, prompt + response), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :2] = 0  # left padding
        mask[1, -2:] = 0  # a short response
        response_ids, response_mask = ids[:, prompt:], mask[:, prompt:].bool()

        def run(policy, critic, policy_backbone, critic_backbone):
            lp, ent = response_logprobs(policy, ids, mask, response_ids, response_mask, 0.7, with_entropy=True,
                                        chunk_size=5, backbone_fn=policy_backbone)
            values = response_values(critic, ids, mask, response, backbone_fn=critic_backbone)
            loss = lp.sum() + (values * response_mask).pow(2).sum()
            params = [p for m in (policy, critic) for p in m.parameters()]
            return [lp.detach(), ent, values.detach(), *torch.autograd.grad(loss, params, allow_unused=True)]

        eager, compiled = run(eager_policy, eager_critic, None, None), run(policy, critic, policy_fn, critic_fn)
        for i, (a, b) in enumerate(zip(eager, compiled)):
            if a is not None:
                # Relative to the tensor's scale: inductor's kernels sum in another order than eager's, and a gradient
                # entry near zero in a tensor whose largest is ~35 differs by ~1e-5 (seen when other tests ran first).
                error, scale = (a - b).abs().max().item(), a.abs().max().item()
                assert error <= 1e-5 * scale + 1e-6, (i, rows, error, scale)


def test_the_compiled_onednn_backbone_is_one_graph_of_the_operator(model_dir):
    """matmul_backend onednn under compile: dynamo traces the routed Linears as `ppokit::onednn_linear` (whose backward
    is registered with it), one graph with no breaks, each plain Linear's product the operator."""
    from transformers import AutoModelForCausalLM

    from ppokit.models.loading import backbone

    policy = AutoModelForCausalLM.from_pretrained(model_dir("llama"))
    linears = onednn.route_linears(policy) - 1  # all but the head, which the backbone does not call
    ids = torch.randint(4, policy.config.vocab_size, (3, 7))
    explained = torch._dynamo.explain(backbone(policy).forward)(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    calls = [n for n in explained.graphs[0].graph.nodes if n.op == "call_function" and n.target is torch.ops.ppokit.onednn_linear.default]
    assert len(calls) == linears > 0


@pytest.mark.slow
def test_a_ppo_run_with_compile_and_onednn_equals_the_eager_default(sft_model_dir, prompts_file, tmp_path):
    """Two updates with compile: true and matmul_backend: onednn: metrics within float32 rounding of eager aten's."""
    from conftest import tiny_ppo_config

    from ppokit.trainer import PPOTrainer

    curve = ("objective/scores", "objective/kl", "objective/entropy", "policy/approxkl_avg", "loss/policy_avg", "loss/value_avg",
             "policy/entropy_avg", "val/ratio")

    def run(name, **switches):
        config = tiny_ppo_config(sft_model_dir, prompts_file, tmp_path / name, total_episodes=32, per_device_train_batch_size=8,
                                 num_mini_batches=2, response_length=8, num_sample_generations=0)
        for key, value in switches.items():
            setattr(config, key, value)
        return PPOTrainer(config, show_progress=False).train()

    default, switched = run("aten"), run("onednn", compile=True, matmul_backend="onednn")
    assert len(default) == len(switched) == 2
    for want, got in zip(default, switched):
        for key in curve:
            # float32 sums in another order (oneDNN's, inductor's) through a few layers and an Adam step: rounding
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (got["update"], key)


def test_compile_where_torch_compile_cannot_run_is_one_clear_error(tmp_path):
    """No C++ compiler for inductor's CPU kernels (a real failure, not a mock): a UserError saying so."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.path.abspath(SRC)}
    code = ("from ppokit.models.compiled import check_available\nfrom ppokit.errors import UserError\n"
            "try:\n    check_available()\nexcept UserError as e:\n    print(e)\nelse:\n    print('no error')\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert out.stdout.startswith("compile: true, but torch.compile cannot run on this machine (")
    assert "no-such-compiler" in out.stdout and "set compile: false" in out.stdout
