"""`matmul_backend: onednn`: the oneDNN linear equals F.linear within float32 rounding, forward and backward; every plain
nn.Linear of a run's models goes through it; a PPO run with it equals the default's within rounding; where it cannot
apply, one clear line."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_ppo_config
from torch import nn

from ppokit.config.fields import load_config
from ppokit.config.schema import PPOConfig
from ppokit.errors import UserError
from ppokit.models import onednn
from ppokit.trainer import PPOTrainer

EPS = torch.finfo(torch.float32).eps

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


def summation_bound(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """Elementwise bound on the difference of two float32 orders of summing a @ b over k terms: each sum's error is at
    most k x eps x (|a| @ |b|), two of them differ by at most twice that."""
    return 2 * k * EPS * (a.abs() @ b.abs()) + 1e-30


@pytest.mark.parametrize("fn", ["linear", "onednn_linear"])  # the operator: compile: true's route (its registered backward)
@pytest.mark.parametrize("lead, k, m, bias", [((7,), 5, 3, True), ((2, 9), 16, 11, False), ((3, 4, 5), 33, 64, True), ((1,), 1, 1, True),
                                              ((300,), 24, 40, True), ((2, 129), 8, 6, False)])
def test_linear_equals_f_linear_forward_and_backward(lead, k, m, bias, fn):
    g = torch.Generator().manual_seed(sum(lead) + k + m)
    x = torch.randn(*lead, k, generator=g, requires_grad=True)
    w = (torch.randn(m, k, generator=g) * 3).requires_grad_()
    b = torch.randn(m, generator=g, requires_grad=True) if bias else None
    grad = torch.randn(*lead, m, generator=g)
    ours, want = getattr(onednn, fn)(x, w, *[b] * bias), F.linear(x, w, b)  # without a bias: called without one
    assert ours.shape == want.shape == (*lead, m)
    x2d, g2d = x.detach().reshape(-1, k), grad.reshape(-1, m)
    bound = summation_bound(x2d, w.detach().t(), k) + (b.detach().abs() * 2 * EPS if bias else 0)
    assert ((ours - want).detach().reshape(-1, m).abs() <= bound).all()
    params = [x, w] + ([b] if bias else [])
    got, expected = torch.autograd.grad(ours, params, grad), torch.autograd.grad(want, params, grad)
    rows = x2d.shape[0]
    assert ((got[0] - expected[0]).reshape(-1, k).abs() <= summation_bound(g2d, w.detach(), m)).all()  # grad_x = g @ W
    assert ((got[1] - expected[1]).abs() <= summation_bound(g2d.t(), x2d, rows)).all()  # grad_W = g^T @ x
    if bias:
        assert ((got[2] - expected[2]).abs() <= 2 * rows * EPS * g2d.abs().sum(0) + 1e-30).all()


def test_linear_without_gradients_and_with_a_frozen_weight():
    x, w = torch.randn(4, 6), torch.randn(5, 6)
    with torch.inference_mode():
        out = onednn.linear(x, w)
    assert not out.requires_grad and torch.equal(out, F.linear(x, w))  # without gradients: F.linear itself
    xg = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(onednn.linear(xg, w).sum(), [xg])  # weight frozen: only grad_x, as under LoRA
    assert torch.allclose(gx, w.sum(0).expand(4, 6), atol=2 * 5 * EPS * w.abs().sum(0).max().item())


def test_route_linears_routes_plain_linears_and_survives_copy_save_and_a_second_call(tmp_path, model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"))
    plain = [m for m in model.modules() if type(m) is nn.Linear]
    ids = torch.arange(12).reshape(2, 6) % model.config.vocab_size
    with torch.no_grad():
        before = model(ids).logits
    assert onednn.route_linears(model) == len(plain) > 0
    assert onednn.route_linears(model) == len(plain)  # idempotent
    assert all(onednn.is_routed(m) for m in plain)
    calls = []
    real = onednn._op
    monkeypatch.setattr(onednn, "_op", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before) and not calls  # no gradients (sampling, scoring): F.linear's own numbers
    after = model(ids).logits
    assert len(calls) == len(plain)  # with gradients: every Linear through oneDNN, the LM head too
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-5)
    twin = copy.deepcopy(model)
    assert all(onednn.is_routed(m) and m.forward.args[0] is m for m in twin.modules() if type(m) is nn.Linear)
    assert set(model.state_dict()) == set(twin.state_dict()) and not any("forward" in k for k in model.state_dict())
    model.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert not any(onednn.is_routed(m) for m in reloaded.modules())
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, before)


def test_bucket_rows_rounds_up_by_less_than_a_quarter_to_a_few_shapes():
    assert onednn.STEPS_PER_DOUBLING == 4
    assert [onednn.bucket_rows(n) for n in (1, 7, 16, 17, 33, 64, 65, 2392, 4096)] == [1, 7, 16, 20, 40, 64, 80, 2560, 4096]
    assert [onednn.bucket_rows(n, 256) for n in (1, 255, 256, 257, 300, 2392)] == [256, 256, 256, 320, 320, 2560]
    for n in range(1, 20000):
        bucket = onednn.bucket_rows(n)
        assert n <= bucket < n * (1 + 1 / onednn.STEPS_PER_DOUBLING) or bucket == n
    assert len({onednn.bucket_rows(n) for n in range(1, 4097)}) == 16 + 8 * 4  # 16 exact, then 4 per doubling
    assert len({onednn.bucket_rows(n, 256) for n in range(1, 4097)}) == 1 + 4 * 4


def test_every_row_count_takes_one_of_a_few_shapes_forward_and_backward(monkeypatch):
    """oneDNN keeps a primitive per shape it is called with (~0.55 MB each, docs/speed.md): 600 row counts, forward and
    both gradients, come to the buckets' shapes only, each product equal to aten's within rounding."""
    shapes = set()
    real = onednn._kernel
    monkeypatch.setattr(onednn, "_kernel", lambda x, w, b: shapes.add((tuple(x.shape), tuple(w.shape))) or real(x, w, b))
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 4, generator=g, requires_grad=True)
    for rows in range(1, 601):
        x = torch.randn(rows, 4, generator=g, requires_grad=True)
        grad = torch.randn(rows, 6, generator=g)
        out = onednn.linear(x, w)
        gx, gw = torch.autograd.grad(out, [x, w], grad)
        assert out.shape == (rows, 6) and gx.shape == (rows, 4) and gw.shape == (6, 4)
        assert ((out - x @ w.t()).abs() <= summation_bound(x.detach(), w.detach().t(), 4)).all()
        assert ((gx - grad @ w.detach()).abs() <= summation_bound(grad, w.detach(), 6)).all()
        assert ((gw - grad.t() @ x.detach()).abs() <= summation_bound(grad.t(), x.detach(), rows)).all()
    buckets = {onednn.bucket_rows(n, onednn.TRAINING_ROWS) for n in range(1, 601)}  # 256, 320, 384, 448, 512, 640
    assert len(buckets) == 6
    assert shapes == {s for b in buckets for s in (((b, 4), (6, 4)), ((b, 6), (4, 6)), ((4, b), (6, b)))}


def test_the_output_cut_from_its_bucket_takes_in_place_ops():
    x, w = torch.randn(5, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    out = onednn.linear(x, w)  # computed over 256 rows, 5 kept
    assert out.shape == (5, 4)
    out.mul_(2)  # an output that were a view made inside the autograd Function would refuse this
    (gx,) = torch.autograd.grad(out.sum(), [x])
    assert torch.allclose(gx, 2 * w.detach().sum(0).expand(5, 3), atol=2 * 4 * EPS * 2 * w.abs().sum().item())


def test_the_operator_of_its_own_equals_f_linear_at_every_row_count():
    w, b = torch.randn(7, 5), torch.randn(7)
    for rows in (1, 17, 37, 64, 65):
        x = torch.randn(2, rows, 5)
        out = onednn.onednn_linear(x, w, b)
        bound = summation_bound(x.reshape(-1, 5), w.t(), 5).reshape(2, rows, 7) + 2 * EPS * b.abs()
        assert out.shape == (2, rows, 7) and ((out - F.linear(x, w, b)).abs() <= bound).all()


def test_a_lora_layer_computes_through_its_routed_base(model_dir):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"))
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    onednn.route_linears(model)
    bases = [m.base_layer for m in model.modules() if isinstance(m, peft.tuners.lora.Linear)]
    assert bases and all(onednn.is_routed(b) for b in bases)
    loss = model(torch.arange(8).reshape(2, 4)).logits.pow(2).mean()
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_linear_under_cpu_autocast_is_f_linears():
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert onednn.linear(x, w).dtype == F.linear(x, w).dtype == torch.bfloat16


def test_route_linears_refuses_weights_that_are_not_float32():
    with pytest.raises(UserError, match=r"matmul_backend: onednn runs float32 weights; 1 is torch.bfloat16"):
        onednn.route_linears(nn.Sequential(nn.ReLU(), nn.Linear(2, 2).to(torch.bfloat16)))


@pytest.mark.parametrize("kwargs, line", [
    (dict(cuda=True, mkldnn=True, strategy="ddp"), "this machine has a CUDA device"),
    (dict(cuda=False, mkldnn=False, strategy="ddp"), "torch.backends.mkldnn.is_available() is false"),
    (dict(cuda=False, mkldnn=True, strategy="fsdp"), "parallel.strategy: fsdp"),
])
def test_where_onednn_cannot_apply_is_one_line(kwargs, line):
    with pytest.raises(UserError, match=r"^matmul_backend: onednn .*" + line.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        onednn.check_available(**kwargs)
    onednn.check_available(cuda=False, mkldnn=True, strategy="ddp")


@pytest.mark.parametrize("key, value", [("bf16", True), ("compile", True)])
def test_the_config_refuses_onednn_with_other_precisions_only(key, value):
    """bf16 is refused; compile goes with it (tests/test_compiled.py checks the compiled products)."""
    data = {"model": "m", "matmul_backend": "onednn", key: value, "reward": {"functions": ["sentiment"]}, "data": {"train": "x.jsonl"}}
    if key == "compile":
        assert load_config(PPOConfig, data=data).compile
        return
    with pytest.raises(UserError, match=f"matmul_backend: onednn .* does not go with {key}"):
        load_config(PPOConfig, data=data)


def test_an_unknown_backend_names_the_key():
    with pytest.raises(UserError, match="matmul_backend"):
        load_config(PPOConfig, data={"model": "m", "matmul_backend": "mkl", "reward": {"functions": ["sentiment"]}, "data": {"train": "x.jsonl"}})


def test_a_ppo_run_with_onednn_routes_every_model_and_equals_the_default(sft_model_dir, prompts_file, tmp_path, monkeypatch):
    """Two updates (sampling, reference, critic, training): metrics within float32 rounding of aten's, and the op ran."""
    curve = ("objective/scores", "objective/kl", "objective/entropy", "policy/approxkl_avg", "loss/policy_avg", "loss/value_avg",
             "policy/entropy_avg", "val/ratio")

    def run(name, backend):
        config = tiny_ppo_config(sft_model_dir, prompts_file, tmp_path / name, total_episodes=32, per_device_train_batch_size=8,
                                 num_mini_batches=2, response_length=8, num_sample_generations=0)
        config.matmul_backend = backend
        trainer = PPOTrainer(config, show_progress=False)
        models = [trainer.model.policy, trainer.model.value_model, trainer.ref_model]
        routed = [onednn.is_routed(m) for model in models if model is not None for m in model.modules() if type(m) is nn.Linear]
        return trainer.train(), routed

    calls = []
    real = onednn._op
    monkeypatch.setattr(onednn, "_op", lambda *a: calls.append(1) or real(*a))
    default, routed = run("aten", "aten")
    assert not calls and not any(routed)
    switched, routed = run("onednn", "onednn")
    assert calls and routed and all(routed)
    assert len(default) == len(switched) == 2
    for want, got in zip(default, switched):
        for key in curve:
            # float32 sums in another order through a few layers and an Adam step (lr 1e-3): rounding, not a difference
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (got["update"], key)
