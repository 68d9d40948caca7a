"""`ppokit plan` and the preflight estimate: counts against real models, formulas, CLI exit codes."""

import json
import re

import pytest
import torch
import yaml
from conftest import tiny_ppo_config

from ppokit.cli import PLAN_DOES_NOT_FIT, main
from ppokit.config.schema import LoraConfig
from ppokit.errors import UserError
from ppokit.plan import HEADROOM, GiB, estimate, plan_for

pytest.importorskip("peft")


def roles_of(plan):
    return {r.role: r for r in plan.roles}


def test_counts_match_the_models_the_trainer_builds(model_dir, prompts_file, tmp_path):
    from ppokit.trainer import PPOTrainer

    for value_model in (None, "shared"):
        config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run")
        config.lora, config.value_model = LoraConfig(r=4, alpha=8), value_model
        plan = plan_for(config)
        trainer = PPOTrainer(config, show_progress=False)
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        roles = roles_of(plan)
        assert roles["policy"].trainable + roles["value"].trainable == trainable
        assert roles["reference"].weights == 0
        base = sum(p.numel() for p in trainer.policy.get_base_model().parameters() if not p.requires_grad)
        assert roles["policy"].params - roles["policy"].trainable == base

    config = tiny_ppo_config(model_dir("gpt2"), prompts_file, tmp_path / "full")
    roles = roles_of(plan_for(config))
    trainer = PPOTrainer(config, show_progress=False)
    assert roles["policy"].params == sum(p.numel() for p in trainer.policy.parameters())
    assert roles["value"].params == sum(p.numel() for p in trainer.value_model.parameters())
    assert roles["reference"].weights == roles["policy"].weights == 4 * roles["policy"].params  # float32
    assert roles["policy"].optimizer == 2 * roles["policy"].gradients  # AdamW: two states per weight


def test_each_switch_lowers_its_own_term(model_dir, prompts_file, tmp_path):
    base = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", per_device_train_batch_size=8,
                           num_mini_batches=1, total_episodes=16)
    device = ("test", 64 * GiB)
    full = estimate(base, 32, 64, device)

    base.gradient_checkpointing = True
    checkpointed = estimate(base, 32, 64, device)
    assert checkpointed.phases["training"] < full.phases["training"]
    assert sum(r.persistent for r in checkpointed.roles) == sum(r.persistent for r in full.roles)

    base.gradient_checkpointing = False
    base.lora = LoraConfig(r=4)
    lora = estimate(base, 32, 64, device)
    assert roles_of(lora)["policy"].optimizer < roles_of(full)["policy"].optimizer / 5
    assert roles_of(lora)["reference"].weights == 0

    base.value_model = "shared"
    shared = estimate(base, 32, 64, device)
    assert roles_of(shared)["value"].weights < roles_of(lora)["value"].weights / 5
    assert shared.total < lora.total < full.total

    longer = estimate(base, 64, 64, device)
    assert longer.phases["sampling"] > shared.phases["sampling"]
    assert shared.sizes.batch == 8 and shared.sizes.num_updates == 2


def test_one_process_holds_one_models_training_activations_at_a_time(model_dir, prompts_file, tmp_path):
    """On one process the policy's terms are back-propagated before the critic's forward: the training phase is
    the larger of the two models' activations; under ddp with several processes, their sum."""
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", per_device_train_batch_size=8,
                             num_mini_batches=1, total_episodes=16)
    device = ("test", 64 * GiB)
    one, two = estimate(config, 32, 64, device, processes=1), estimate(config, 32, 64, device, processes=2)
    policy, value = roles_of(one)["policy"].activations, roles_of(one)["value"].activations
    assert policy > 0 and value > 0
    assert one.phases["training"] == max(policy, value)
    assert two.phases["training"] == policy + value


@pytest.fixture
def big_model_dir(tmp_path, tokenizer):
    """A config.json of a 13B-parameter Llama and a tokenizer, no weights: plan never needs the weights (the run's
    start-up checks, which plan runs too, read the tokenizer)."""
    from transformers import LlamaConfig

    path = tmp_path / "llama-13b"
    LlamaConfig(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                vocab_size=32000, dtype=torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_config(path, **data):
    path.write_text(yaml.safe_dump(data))
    return path


def test_plan_cli_fits_and_does_not_fit(model_dir, prompts_file, big_model_dir, tmp_path, capsys):
    common = {"reward": {"functions": ["sentiment"]}, "data": {"train": str(prompts_file)},
              "ppo": {"total_episodes": 16, "per_device_train_batch_size": 4, "response_length": 8}}
    small = write_config(tmp_path / "small.yaml", model=str(model_dir("llama")), **common)
    assert main(["plan", str(small)]) == 0
    out = capsys.readouterr().out
    for word in ("policy", "reference", "value", "weights", "grads", "optim", "fits", "rollout batch 4"):
        assert word in out

    big = write_config(tmp_path / "big.yaml", model=str(big_model_dir), **common)
    assert main(["plan", str(big), "--json", "--device-memory", "80"]) == PLAN_DOES_NOT_FIT
    report = json.loads(capsys.readouterr().out)
    assert not report["fits"] and report["total_bytes"] > 13e9 * 2 * 3  # three bf16 copies at least
    assert report["roles"][0]["params"] > 12e9
    assert report["suggestion"] and report["suggestion"].startswith("lora: {}")

    assert main(["plan", str(big), "lora={}", "value_model=shared", "--device-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "adapter disabled (no copy)" in out and "on the policy's base (no copy)" in out

    for memory in ("0", "-3", "inf", "nan"):  # 0 was read as "not given" (this machine's memory), -3 planned against
        assert main(["plan", str(small), "--device-memory", memory]) == 2
        assert capsys.readouterr().err == f"ppokit: error: --device-memory {float(memory):g}: must be a number of GiB > 0\n"

    # The share in words: "estimated peak 22.9M of 23.54G" read as nearly full at a glance.
    assert main(["plan", str(small), "--json", "--device-memory", "0.25"]) == 0
    report = json.loads(capsys.readouterr().out)
    share = 100 * report["total_bytes"] / report["device_memory_bytes"]
    assert main(["plan", str(small), "--device-memory", "0.25"]) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(r"estimated peak [\d.]+M: ([\d.]+)% of 0\.25G \(given 0\.25 GiB, 90% usable\): fits", summary), summary
    assert float(re.fullmatch(r".*: ([\d.]+)% of .*", summary).group(1)) == pytest.approx(share, abs=0.05), (summary, share)

    assert main(["plan", str(small), "parallel.strategy=fsdp"]) == 0
    assert "; fsdp, per device of 1 process, 90% usable): fits" in capsys.readouterr().out  # not "1 processes"

    assert main(["plan", str(small), "ppo.no_such_key=1"]) == 2
    assert "ppo.no_such_key" in capsys.readouterr().err
    assert main(["plan", str(small), "value_model=shared"]) == 2


def test_ppo_command_prints_the_plan_first(model_dir, prompts_file, big_model_dir, tmp_path, capsys):
    config = write_config(
        tmp_path / "run.yaml", model=str(model_dir("llama")), output_dir=str(tmp_path / "run"),
        reward={"functions": ["sentiment"]}, data={"train": str(prompts_file)},
        ppo={"total_episodes": 4, "per_device_train_batch_size": 4, "num_ppo_epochs": 1, "response_length": 4,
             "num_sample_generations": 0},
    )
    assert main(["ppo", str(config)]) == 0
    err = capsys.readouterr().err
    assert "plan: estimated peak" in err and "fits" in err


def test_plan_reads_chat_prompts_and_the_eval_hold_out_as_the_trainer_does(model_dir, tmp_path):
    from ppokit.data.prompts import as_prompt_dataset, render_chat_prompts
    from ppokit.models.loading import load_tokenizer
    from ppokit.plan import data_shape

    chats = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "system", "content": "be kind"}, {"role": "user", "content": "the movie was " * (i + 1)}]} for i in range(10)]
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tiny_ppo_config(model_dir("llama"), chats, tmp_path / "run", total_episodes=None)
    config.data.eval_fraction = 0.2
    longest, num_prompts, notes = data_shape(config)
    tokenizer = load_tokenizer(config.model)
    trainer_prompts = as_prompt_dataset(str(chats))
    render_chat_prompts(tokenizer, None, trainer_prompts)  # what PPOTrainer does with chat rows
    assert longest == max(len(tokenizer(p)["input_ids"]) for p in trainer_prompts.prompts) > 30
    assert num_prompts == 8 and not notes  # 2 of 10 held out for evaluation


def test_plan_per_device_under_ddp_and_fsdp_and_the_smallest_process_count_that_fits(big_model_dir, prompts_file, tmp_path, capsys):
    config = write_config(tmp_path / "big.yaml", model=str(big_model_dir), bf16=True, reward={"functions": ["sentiment"]},
                          data={"train": str(prompts_file)},
                          ppo={"total_episodes": 64, "per_device_train_batch_size": 4, "response_length": 64})
    assert main(["plan", str(config), "--json", "--device-memory", "80", "--processes", "2"]) == PLAN_DOES_NOT_FIT
    two = json.loads(capsys.readouterr().out)
    assert two["strategy"] == "ddp" and two["processes"] == 2 and two["sizes"]["batch"] == 8  # 2 x 4 episodes per update
    ddp, fsdp = two["per_device"]["ddp"], two["per_device"]["fsdp"]
    for role in ("policy", "value", "reference"):  # the frozen reference is sharded too (parallel.shard_frozen)
        assert fsdp["roles"][role] == -(-ddp["roles"][role] // 2)
    assert two["suggestion"].startswith("lora: {}")  # the switches at this process count, as before
    assert two["sharding_suggestion"].startswith("parallel.strategy: fsdp with 8 processes (estimated ")

    # The suggestion fits, and 4 processes (the next smaller power of two) does not.
    assert main(["plan", str(config), "parallel.strategy=fsdp", "--json", "--device-memory", "80", "--processes", "8"]) == 0
    eight = json.loads(capsys.readouterr().out)
    assert eight["fits"] and eight["total_bytes"] == eight["per_device"]["fsdp"]["total_bytes"]
    assert main(["plan", str(config), "parallel.strategy=fsdp", "--json", "--device-memory", "80", "--processes", "4"]) == PLAN_DOES_NOT_FIT
    capsys.readouterr()

    # Frozen roles kept whole; the table shows both columns; a bad count is refused.
    assert main(["plan", str(config), "parallel.strategy=fsdp", "parallel.shard_frozen=false", "--device-memory", "80",
                 "--processes", "8"]) == PLAN_DOES_NOT_FIT
    table = capsys.readouterr().out
    assert "ddp/dev" in table and "fsdp/dev" in table and "per device with 8 processes" in table
    reference = next(line for line in table.splitlines() if line.startswith("reference"))
    assert reference.split()[7] == reference.split()[8]  # whole under both strategies
    assert main(["plan", str(config), "--processes", "0"]) == 2
    assert "--processes 0: must be at least 1" in capsys.readouterr().err


def test_a_token_budget_counts_only_the_tokens_a_micro_batch_can_hold(model_dir, prompts_file, tmp_path, capsys):
    """A budget packs rows of one minibatch: a micro-batch never holds more than the minibatch's rows x (prompt +
    response), however large the budget (1e12 was counted whole: 7.6 PB, and the run refused)."""
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, num_mini_batches=1, total_episodes=8,
                             local_rollout_forward_batch_size=1)  # training is the largest phase
    device = ("test", 64 * GiB)
    seq = 32 + config.ppo.response_length
    plans = {}
    for budget in (8 * seq, 10**12):
        config.ppo.max_tokens_per_micro_batch = budget
        plans[budget] = estimate(config, 32, 64, device)
    assert plans[10**12].sequence["micro_batch_tokens"] == 8 * seq  # the minibatch's 8 rows
    assert plans[10**12].phases == plans[8 * seq].phases and plans[10**12].fits
    path = write_config(tmp_path / "small.yaml", model=str(model_dir("llama")), reward={"functions": ["sentiment"]},
                        data={"train": str(prompts_file)}, ppo={"total_episodes": 8, "per_device_train_batch_size": 4,
                                                                 "response_length": 8, "max_tokens_per_micro_batch": 10**12})
    assert main(["plan", str(path)]) == 0
    capsys.readouterr()

    # Where the budget is what does not fit (a whole minibatch of 8 rows per micro-batch; without a budget 4 rows),
    # the suggestion names it with the value that fits: it was blank, the budget "left out again" as null.
    config.lm_head_chunk_size = 64  # so that the budget is the first switch tried
    config.ppo.max_tokens_per_micro_batch = None
    without = estimate(config, 32, 64, device).total
    config.ppo.max_tokens_per_micro_batch = 10**12
    whole = estimate(config, 32, 64, device).total
    assert whole > without
    between = ("test", int((whole + without) / 2 / HEADROOM))
    plan = estimate(config, 32, 64, between)
    assert not plan.fits and plan.suggestion.startswith("ppo.max_tokens_per_micro_batch: ")
    rows = int(plan.suggestion.split(": ")[1].split(" ")[0]) // seq
    assert 4 <= rows < 8


@pytest.mark.parametrize(
    "args, message",
    [
        (["ppo.total_episodes=12"], "ppo.total_episodes (12) is not a multiple of the batch size (8 = per_device_train_batch_size 4 x "
         "gradient_accumulation_steps 1 x num_mini_batches 2 x processes 1)"),
        (["--processes", "3"], "ppo.total_episodes (16) is not a multiple of the batch size (24 = "),
        (["--processes", "1000000"], "ppo.total_episodes (16) is not a multiple of the batch size (8000000 = "),
        (["ppo.total_episodes=1e23"], "ppo.total_episodes: expected an integer, got '1e23'"),
        (["ppo.warmup_steps=4"], "ppo.warmup_steps (4) is not shorter than the run's 4 optimiser steps"),
        (["ppo.total_episodes=null", "ppo.per_device_train_batch_size=64"], "ppo.total_episodes: "
                                                                            "64 training prompts x 1 epoch(s) is less than one batch of 128"),
    ],
)
def test_plan_refuses_what_the_run_refuses_with_the_same_line(model_dir, prompts_file, tmp_path, capsys, monkeypatch, args, message):
    path = write_config(tmp_path / "ppo.yaml", model=str(model_dir("llama")), output_dir=str(tmp_path / "run"),
                        reward={"functions": ["sentiment"]}, data={"train": str(prompts_file)},
                        ppo={"total_episodes": 16, "per_device_train_batch_size": 4, "num_mini_batches": 2, "num_ppo_epochs": 1,
                             "response_length": 4})
    assert main(["plan", str(path), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"ppokit: error: {message}") and captured.err.count("\n") == 1
    if "--processes" in args:  # `ppokit ppo` reads the process count from its launcher's WORLD_SIZE
        monkeypatch.setenv("WORLD_SIZE", args[1])
        args = []
    assert main(["ppo", str(path), *args]) == 2
    assert capsys.readouterr().err == captured.err
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_ppo_preflight_suggests_sharding_when_the_model_does_not_fit(big_model_dir, prompts_file, tmp_path, monkeypatch, capsys):
    from ppokit.cli import _preflight
    from ppokit.config.schema import PPOConfig

    config = PPOConfig.load(write_config(tmp_path / "big.yaml", model=str(big_model_dir), bf16=True, reward={"functions": ["sentiment"]},
                                         data={"train": str(prompts_file)}, output_dir=str(tmp_path / "run"),
                                         ppo={"total_episodes": 64, "per_device_train_batch_size": 4, "response_length": 64}))
    monkeypatch.setattr("ppokit.plan.device_memory", lambda: ("cuda:0 test", 80 * GiB))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="ddp, per device of 2 processes.*DOES NOT FIT.*it would fit with parallel.strategy: fsdp with 8 processes"):
        _preflight(config)  # the run stops before any weights load
    _preflight(config, ignore_plan=True)  # --ignore-plan: the verdict and the way out are printed, and the run starts
    err = capsys.readouterr().err
    assert "ddp, per device of 2 processes" in err and "DOES NOT FIT" in err
    assert "plan: would fit with: parallel.strategy: fsdp with 8 processes" in err


def test_the_plan_reads_prompts_and_position_limits_as_the_trainer_does(model_dir, prompts_file, tmp_path, capsys):
    """Prompt lengths under the same rule (lengths.encode_prompts), and the smallest position limit
    of the models that read the policy's ids: `ppokit plan` names the problem; `ppokit ppo`'s
    preflight leaves it to the trainer's own one-line error."""
    from ppokit.trainer import PPOTrainer

    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", response_length=6)
    config.data.max_prompt_length = 4
    trainer = PPOTrainer(config, show_progress=False)
    assert plan_for(config).sequence["prompt"] == max(len(ids) for ids in trainer.train_query_ids) == 4
    assert plan_for(config).stops == []
    config.ref_model = str(model_dir("gpt2", max_positions=8))
    plan = plan_for(config)
    assert plan.stops == ["the longest prompt + response is 10 tokens (4 + ppo.response_length 6), over the ref_model's position "
                          "limit of 8 tokens (n_positions in its config): `ppokit ppo` will stop; set data.max_prompt_length to at "
                          "most 2 (it is 4)"]
    assert "error: the longest prompt + response is 10 tokens" in plan.render()
    path = tmp_path / "ppo.yaml"
    config.save(path)
    for json_flag in ([], ["--json"]):  # `ppokit plan` fails as the run would: exit 2, the stop on stderr
        assert main(["plan", str(path), *json_flag]) == 2
        captured = capsys.readouterr()
        assert captured.err.splitlines() == [f"ppokit: error: {plan.stops[0]}"]
        assert ("error: the longest prompt" in captured.out) if not json_flag else json.loads(captured.out)["stops"] == plan.stops
    assert main(["ppo", str(path)]) == 2
    err = capsys.readouterr().err
    assert "the longest prompt" not in err and "over the ref_model's position limit of 8 tokens" in err.splitlines()[-1]


@pytest.fixture
def long_vocab_model_dir(tmp_path):
    """A config.json of a small Llama with a 128k vocabulary, where the LM head's float32 logits dominate activations."""
    from transformers import LlamaConfig

    path = tmp_path / "llama-128k"
    LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                vocab_size=128256, tie_word_embeddings=True, dtype=torch.bfloat16).save_pretrained(path)
    return path


def test_plan_counts_the_lm_head_in_both_modes_and_suggests_a_token_budget(long_vocab_model_dir, prompts_file, tmp_path):
    config = tiny_ppo_config(long_vocab_model_dir, prompts_file, tmp_path / "run", per_device_train_batch_size=32,
                             num_mini_batches=1, total_episodes=32, response_length=256)
    device = ("test", 16 * GiB)
    direct = estimate(config, 256, 64, device)
    head = 4 * 32 * 257 * 128256 * 4  # four float32 copies of the micro-batch's logits
    assert direct.phases["training"] > head
    assert not direct.fits

    config.lm_head_chunk_size = 1024
    light = estimate(config, 256, 64, device)
    assert direct.phases["training"] - light.phases["training"] == head - 2 * 1024 * 128256 * 4  # a chunk's logits and gradient
    assert light.fits and light.total < direct.total / 3
    assert light.phases["forward"] < direct.phases["forward"]  # the reference pass's logits, chunked too
    assert light.sequence["lm_head_positions"] == 1024

    config.ppo.max_tokens_per_micro_batch = 4 * 512
    budget = estimate(config, 256, 64, device)
    assert budget.sequence["micro_batch_tokens"] == 2048
    chunk_bytes = 2 * 1024 * 128256 * 4  # the same light head in both
    # 4 of the 32 longest rows per micro-batch: the backbones' activations are an eighth.
    assert (light.phases["training"] - chunk_bytes) == 8 * (budget.phases["training"] - chunk_bytes)

    config.lm_head_chunk_size, config.ppo.max_tokens_per_micro_batch = None, None
    small_device = ("test", int(2.5 * GiB))
    suggestion = estimate(config, 256, 64, small_device).suggestion
    assert suggestion.startswith("lm_head_chunk_size: 256; ppo.max_tokens_per_micro_batch: ")  # 128 MiB of logits per chunk
    tokens = int(suggestion.split("ppo.max_tokens_per_micro_batch: ")[1].split(" ")[0].rstrip(";"))
    assert tokens % 512 == 0 and 512 <= tokens < 32 * 512  # whole longest rows, fewer than a fixed micro-batch's
    config.lm_head_chunk_size, config.ppo.max_tokens_per_micro_batch = 256, tokens
    assert estimate(config, 256, 64, small_device).fits
    config.ppo.max_tokens_per_micro_batch = tokens + 512
    assert not estimate(config, 256, 64, small_device).fits  # the largest budget that fits


CUSTOM_CONFIG = """from transformers import LlamaConfig


class CustomConfig(LlamaConfig):
    model_type = "ppokit_custom"
"""
CUSTOM_MODELING = """from torch import nn
from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel, LlamaPreTrainedModel

from .configuration_custom import CustomConfig


class CustomModel(LlamaModel):
    config_class = CustomConfig


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig


class CustomForSequenceClassification(LlamaForSequenceClassification):
    config_class = CustomConfig

    def __init__(self, config):
        LlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = CustomModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()
"""


def test_plan_of_a_model_with_its_own_code_never_asks_on_the_terminal(model_dir, prompts_file, tmp_path):
    """trust_remote_code: true reaches every model the plan builds on meta (no "Do you wish to run the custom code?")."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import ppokit

    custom = tmp_path / "custom"
    shutil.copytree(model_dir("llama"), custom, ignore=shutil.ignore_patterns("*.safetensors"))
    (custom / "configuration_custom.py").write_text(CUSTOM_CONFIG)
    (custom / "modeling_custom.py").write_text(CUSTOM_MODELING)
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="ppokit_custom", architectures=["CustomForCausalLM"], auto_map={
        "AutoConfig": "configuration_custom.CustomConfig", "AutoModel": "modeling_custom.CustomModel",
        "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
        "AutoModelForSequenceClassification": "modeling_custom.CustomForSequenceClassification",
    })
    (custom / "config.json").write_text(json.dumps(config))
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump({"model": str(custom), "trust_remote_code": True, "reward": {"functions": ["sentiment"]},
                                    "data": {"train": str(prompts_file)}, "ppo": {"total_episodes": 8, "per_device_train_batch_size": 4}}))
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"),
               PYTHONPATH=os.pathsep.join([str(Path(ppokit.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "ppokit", "plan", str(path)], stdin=subprocess.DEVNULL, capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "custom code" not in result.stdout + result.stderr and "Traceback" not in result.stderr
    assert "fits" in result.stdout
    refused = subprocess.run([sys.executable, "-m", "ppokit", "plan", str(path), "trust_remote_code=false"], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, env=env, timeout=300)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith(f"ppokit: error: model: could not read the config of '{custom}'")


def test_plan_counts_the_nonfinite_rollback_copy(model_dir, prompts_file, tmp_path):
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run")
    off = plan_for(config)
    assert off.rollback == "off" and off.rollback_bytes() == 0 and "non-finite rollback" not in off.render()
    trainable = sum(r.gradients + r.optimizer for r in off.roles)  # trainable weights + AdamW's two moments
    assert trainable == 3 * sum(r.gradients for r in off.roles) > 0
    for mode, where in (("memory", "host memory"), ("disk", "the run folder")):
        config.ppo.nonfinite_rollback = mode
        plan = plan_for(config)
        assert plan.rollback_bytes() == trainable and plan.to_dict()["rollback"] == {"mode": mode, "bytes_per_process": trainable}
        assert f"(ppo.nonfinite_rollback: {mode})" in plan.render() and where in plan.render()
        assert plan.total == off.total  # none of it is on the device
    config.parallel.strategy = "fsdp"
    assert plan_for(config, processes=2).rollback_bytes() == -(-trainable // 2)  # each process copies its shard


def test_the_shared_prompt_counts_each_groups_prompt_once(model_dir, prompts_file, tmp_path):
    """ppo.shared_prompt: a micro-batch of 8 rows in groups of 4 is 2 rows of one prompt and 4 responses."""
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", per_device_train_batch_size=8, num_mini_batches=1,
                             total_episodes=8, advantage_estimator="grpo", num_samples_per_prompt=4, local_rollout_forward_batch_size=8)
    device = ("test", 64 * GiB)
    room = config.ppo.response_length
    separate = estimate(config, 32, 64, device)
    config.ppo.shared_prompt = True
    shared = estimate(config, 32, 64, device)
    assert separate.sequence["micro_batch_tokens"] == 8 * (32 + room)
    assert shared.sequence["micro_batch_tokens"] == 2 * (32 + 4 * room)
    assert shared.total < separate.total
