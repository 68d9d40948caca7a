"""`ppokit sft`, `ppokit rm`, `ppokit pipeline` and `ppokit data inspect` on tiny local models."""

import contextlib
import json
import math
import random
import re

import pytest
import torch
import yaml

from ppokit.training import algo
from ppokit.cli import main
from ppokit.config.stages import RMConfig, SFTConfig
from ppokit.demos.reviews import NEGATIVE, OPENERS, POSITIVE, _review
from ppokit.errors import UserError
from ppokit.stages.data_inspect import inspect_data
from ppokit.stages.pipeline import differences, run_pipeline
from ppokit.stages.rm import run_rm
from ppokit.stages.sft import run_sft


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def preference_rows(n, seed=1):
    """Generated movie reviews: chosen = a positive review, rejected = a negative one."""
    rng = random.Random(seed)
    return [{"prompt": rng.choice(OPENERS), "chosen": _review(rng, POSITIVE), "rejected": _review(rng, NEGATIVE)} for _ in range(n)]


@pytest.fixture(scope="module")
def files(tmp_path_factory, demo_data):
    d = tmp_path_factory.mktemp("stage-data")
    chat = [
        {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
        for r in demo_data["sft"][:64]
    ]
    alpaca = [{"instruction": "review", "input": r["prompt"], "output": r["completion"]} for r in demo_data["sft"][:64]]
    return {
        "sft": write_jsonl(d / "sft.jsonl", demo_data["sft"]),
        "chat": write_jsonl(d / "chat.jsonl", chat),
        "alpaca": write_jsonl(d / "alpaca.jsonl", alpaca),
        "pref": write_jsonl(d / "pref.jsonl", preference_rows(256)),
        "prompts": write_jsonl(d / "prompts.jsonl", [{"prompt": r["prompt"]} for r in demo_data["prompts"]]),
    }


def sft_config(model, train, out, **data):
    return SFTConfig.load(
        data={
            "model": str(model), "output_dir": str(out),
            "data": {"train": train, "eval_fraction": 0.1, **data},
            "train": {"learning_rate": 3e-3, "per_device_train_batch_size": 16, "num_train_epochs": 1},
        }
    )


# --------------------------------------------------------------------------- algo


def test_bradley_terry_loss_by_hand():
    # differences 1 and 0: (-log sigmoid(1) - log sigmoid(0)) / 2 = (0.313262 + 0.693147) / 2
    loss = algo.bradley_terry_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
    assert loss.item() == pytest.approx((math.log(1 + math.exp(-1)) + math.log(2)) / 2, abs=1e-6)
    assert loss.item() == pytest.approx(0.503204, abs=1e-6)
    # swapping chosen and rejected raises the loss; a huge wrong margin stays finite
    assert algo.bradley_terry_loss(torch.tensor([0.0]), torch.tensor([1.0])).item() == pytest.approx(1.313262, abs=1e-6)
    assert algo.bradley_terry_loss(torch.tensor([-1000.0]), torch.tensor([1000.0])).item() == pytest.approx(2000.0)


# --------------------------------------------------------------------------- sft


def test_sft_prompt_completion_with_eval_loss_and_ppo_usable_output(model_dir, files, tmp_path):
    out = tmp_path / "sft"
    summary = run_sft(sft_config(model_dir("llama"), files["sft"], out), show_progress=False)
    assert summary["train_rows"] == 360 and summary["eval_rows"] == 40
    assert summary["eval_loss"] < summary["first_loss"]
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert recorded["data"]["chat_template"] is None  # no chat rows
    lines = [json.loads(row) for row in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["eval_loss"] == pytest.approx(summary["eval_loss"])
    assert not list(tmp_path.glob(".sft.tmp-*"))


@pytest.mark.parametrize("kind", ["chat", "alpaca"])
def test_sft_chat_data_records_the_template(model_dir, files, tmp_path, kind):
    from transformers import AutoTokenizer

    out = tmp_path / "sft"
    summary = run_sft(sft_config(model_dir("llama"), files[kind], out), show_progress=False)
    assert summary["format"] == ("messages" if kind == "chat" else "alpaca")
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert "assistant:" in recorded["data"]["chat_template"]  # the plain fallback: the tokenizer had none
    assert AutoTokenizer.from_pretrained(out).chat_template == recorded["data"]["chat_template"]


def test_completion_only_loss_switch(tokenizer):
    from ppokit.training.sft import IGNORE_INDEX, encode_pair

    _, labels = encode_pair(tokenizer, "the movie was", "great .", completion_only_loss=True)
    assert labels[:3] == [IGNORE_INDEX] * 3 and labels[-1] == tokenizer.eos_token_id
    ids, labels = encode_pair(tokenizer, "the movie was", "great .", completion_only_loss=False)
    assert labels == ids


def test_sft_interrupted_leaves_no_output(model_dir, files, tmp_path, monkeypatch):
    import ppokit.stages.sft as stage

    real = stage.train_sft

    def crash_after_training(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(stage, "train_sft", crash_after_training)
    with pytest.raises(KeyboardInterrupt):
        run_sft(sft_config(model_dir("llama"), files["sft"], tmp_path / "sft"), show_progress=False)
    assert not (tmp_path / "sft").exists()


def test_long_prompts_truncated_and_counted_then_all_dropped_is_an_error(model_dir, tmp_path):
    rows = [{"prompt": "the movie was " * (20 if i % 2 else 1), "completion": "great ."} for i in range(20)]
    train = write_jsonl(tmp_path / "long.jsonl", rows)
    summary = run_sft(sft_config(model_dir("llama"), train, tmp_path / "a", eval_fraction=0.0, max_prompt_length=8), show_progress=False)
    assert summary["length_rule"]["train"] == {"rows": 20, "prompts_truncated": 10, "completions_cut": 0, "dropped": 0,
                                               "identical_pairs": 0}
    with pytest.raises(UserError, match="no training rows left after the length rule .*20 rows dropped"):
        run_sft(sft_config(model_dir("llama"), train, tmp_path / "b", eval_fraction=0.0, max_prompt_length=8, max_length=3), show_progress=False)


def test_wrong_data_and_missing_model(model_dir, files, tmp_path):
    with pytest.raises(UserError, match="`ppokit sft` needs .*preference"):
        run_sft(sft_config(model_dir("llama"), files["pref"], tmp_path / "s"), show_progress=False)
    config = RMConfig.load(data={"model": str(model_dir("llama")), "output_dir": str(tmp_path / "r"), "data": {"train": files["prompts"]}})
    with pytest.raises(UserError, match="`ppokit rm` needs preference pairs"):
        run_rm(config, show_progress=False)
    with pytest.raises(UserError, match="model: model path .*no-such-model does not exist"):
        run_sft(sft_config(tmp_path / "no-such-model", files["sft"], tmp_path / "s"), show_progress=False)
    assert not (tmp_path / "s").exists() and not (tmp_path / "r").exists()


def test_tokenizer_without_pad_token_uses_eos(files, tmp_path, demo_data):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from ppokit.demos.tiny import tiny_causal_lm, word_tokenizer

    full = word_tokenizer(r["prompt"] + " " + r["completion"] for r in demo_data["sft"])
    no_pad = PreTrainedTokenizerFast(tokenizer_object=full.backend_tokenizer, eos_token="<eos>", unk_token="<unk>")
    assert no_pad.pad_token is None
    model_path = tmp_path / "no-pad"
    tiny_causal_lm("gpt2", full).save_pretrained(model_path)
    no_pad.save_pretrained(model_path)
    run_sft(sft_config(model_path, files["sft"], tmp_path / "out"), show_progress=False)
    saved = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert saved.pad_token == "<eos>"


def test_a_tokenizer_folder_without_config_json_is_accepted(model_dir, files, tokenizer, tmp_path, capsys):
    """`tokenizer:` is any folder a transformers tokenizer loads from, e.g. one `save_pretrained` wrote."""
    folder = tmp_path / "tok"
    tokenizer.save_pretrained(folder)
    assert not (folder / "config.json").exists()
    config = sft_config(model_dir("llama"), files["sft"], tmp_path / "out")
    config.tokenizer = str(folder)
    assert run_sft(config, show_progress=False)["train_rows"] > 0
    assert main(["data", "inspect", files["sft"], "--tokenizer", str(folder)]) == 0
    assert "rows           400" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a tokenizer")
    for argv in (["data", "inspect", files["sft"], "--tokenizer", str(empty)],
                 ["sft", str(_yaml(tmp_path, model_dir("llama"), files["sft"], tokenizer=str(empty)))]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err == (f"ppokit: error: tokenizer: {empty} exists but holds neither a saved tokenizer "
                       "(tokenizer_config.json, tokenizer.json, vocab files) nor a saved model (config.json)")
    assert main(["data", "inspect", files["sft"], "--tokenizer", str(empty / "notes.txt")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"tokenizer: {empty / 'notes.txt'} is a file; give a saved tokenizer or model folder")


def _yaml(tmp_path, model, train, **keys):
    path = tmp_path / "stage.yaml"
    path.write_text(yaml.safe_dump({"model": str(model), "output_dir": str(tmp_path / "o"), "data": {"train": train}, **keys}))
    return path


# --------------------------------------------------------------------------- the pipeline


PPO_SECTION = {
    "ppo": {
        "total_episodes": 384, "per_device_train_batch_size": 16, "num_mini_batches": 2, "num_ppo_epochs": 2,
        "response_length": 12, "temperature": 1.0, "learning_rate": 1e-3, "num_sample_generations": 0,
    }
}


def pipeline_data(model, files, out):
    return {
        "output_dir": str(out),
        "sft": {"model": str(model), "data": {"train": files["sft"], "eval_fraction": 0.1},
                "train": {"learning_rate": 3e-3, "per_device_train_batch_size": 32, "num_train_epochs": 4}},
        "rm": {"data": {"train": files["pref"], "eval_fraction": 0.1}, "train": {"learning_rate": 1e-3, "per_device_train_batch_size": 16}},
        "ppo": {"data": {"train": files["prompts"]}, **PPO_SECTION},
    }


@pytest.fixture(scope="module")
def pipeline_run(model_dir, files, tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    config = pipeline_data(model_dir("llama"), files, out)
    return config, run_pipeline(data=config, show_progress=False)


def test_pipeline_gives_an_accurate_reward_model_and_a_rising_score(pipeline_run):
    """The issue's 'done when': sft -> rm -> ppo on generated movie reviews."""
    config, summary = pipeline_run
    rm, ppo = summary["rm"], summary["ppo"]
    print(f"\nrm eval accuracy {rm['eval_accuracy_before']:.3f} -> {rm['eval_accuracy']:.3f} on {rm['eval_pairs']} pairs, "
          f"margin {rm['eval_margin']:+.3f}; ppo reward-model score by update {[round(s, 3) for s in ppo['scores']]}")
    assert rm["eval_pairs"] >= 20
    assert rm["eval_accuracy"] >= 0.85 and rm["eval_margin"] > 0.5
    first, last = sum(ppo["scores"][:3]) / 3, sum(ppo["scores"][-3:]) / 3
    assert last > first + 0.15
    out = config["output_dir"]
    ppo_recorded = yaml.safe_load(open(f"{out}/ppo/config.yaml"))
    assert ppo_recorded["model"] == f"{out}/sft"
    assert ppo_recorded["reward"]["model"] == f"{out}/rm" and ppo_recorded["value_model"] == f"{out}/rm"
    # every saved model has its card: what it came from and how it ended
    sft_card, rm_card, ppo_card = (open(f"{out}/{path}/README.md").read() for path in ("sft", "rm", "ppo/final"))
    assert "pipeline_tag: text-generation" in sft_card and f"| base model | `{config['sft']['model']}` |" in sft_card
    assert "| `train.learning_rate` | 0.003 |" in sft_card and "| `last_loss` |" in sft_card and "(`ppokit sft`)" in sft_card
    assert "pipeline_tag: text-classification" in rm_card and f"| base model | `{out}/sft` |" in rm_card
    assert f"| `eval_accuracy` | {rm['eval_accuracy']:.6g} |" in rm_card and "AutoModelForSequenceClassification.from_pretrained" in rm_card
    assert f"| reward | reward model `{out}/rm` |" in ppo_card and f"| base model | `{out}/sft` |" in ppo_card


def test_pipeline_skips_completed_stages_and_reruns_changed_ones(pipeline_run, capsys):
    config, _ = pipeline_run
    again = run_pipeline(data=config, show_progress=True)
    assert all(s.get("skipped") for s in again.values())
    assert "sft: skipped" in capsys.readouterr().err
    ran = []
    changed = json.loads(json.dumps(config))
    changed["rm"]["train"]["learning_rate"] = 5e-4
    run_pipeline(data=changed, show_progress=True, runner=lambda stage, cfg, show, overwrite: ran.append(stage) or {})
    assert ran == ["rm", "ppo"]  # ppo follows because its reward model changes
    assert "rm: " in capsys.readouterr().err


def test_pipeline_reruns_ppo_without_final(tmp_path):
    from ppokit.run.run_dir import write_marker

    out = tmp_path / "ppo"
    out.mkdir()
    write_marker(out, "ppo-run")  # a ppo run that stopped before its final save
    (out / "config.yaml").write_text("seed: 42\n")
    ran = []
    config = {"ppo": {"model": "m", "output_dir": str(out), "reward": {"functions": ["sentiment"]}, "data": {"train": "x.jsonl"}}}
    run_pipeline(data=config, show_progress=False, runner=lambda stage, cfg, show, overwrite: ran.append(stage) or {})
    assert ran == ["ppo"]


def test_pipeline_validates_every_section_before_running(model_dir, files, tmp_path):
    config = pipeline_data(model_dir("llama"), files, tmp_path)
    config["ppo"]["ppo"]["learnin_rate"] = 1.0
    with pytest.raises(UserError, match="ppo: unknown config key ppo.learnin_rate"):
        run_pipeline(data=config, show_progress=False)
    assert not (tmp_path / "sft").exists()


def test_config_differences_treat_null_as_any():
    assert differences({"a": None, "b": {"c": 1}}, {"a": "x", "b": {"c": 1}}) == []
    assert differences({"a": 1, "b": {"c": 1}}, {"a": 1, "b": {"c": 2}}) == ["b.c"]


# --------------------------------------------------------------------------- data inspect and the CLI


def test_data_inspect_reports_counts_at_the_limits(files, tokenizer):
    report = inspect_data(files["pref"], tokenizer, max_prompt_length=2, max_length=6)
    assert report["format"] == "preference" and report["stage"] == "rm" and report["rows"] == 256
    assert report["columns"] == ["chosen", "prompt", "rejected"]
    assert set(report["lengths"]) == {"prompt", "chosen", "rejected", "total_chosen", "total_rejected"}
    rule = report["length_rule"]
    assert rule["prompts_truncated"] > 0 and rule["completions_cut"] + rule["dropped"] == 256
    assert len(report["examples"]) == 3 and {"prompt", "chosen", "rejected"} <= set(report["examples"][0])
    plain = inspect_data(files["chat"])
    assert plain["length_unit"] == "characters" and plain["length_rule"] is None
    assert plain["examples"][0]["prompt"].endswith("assistant:")


def test_data_inspect_reads_chats_without_answers_as_ppo_prompts(tmp_path, tokenizer):
    user_turns = [{"messages": [{"role": "user", "content": "the movie was"}]}] * 4
    report = inspect_data(write_jsonl(tmp_path / "chat_prompts.jsonl", user_turns), tokenizer)
    assert report["format"] == "messages" and report["stage"] == "ppo"
    assert report["examples"][0]["prompt"].endswith("assistant:")
    answered = [{"messages": [*r["messages"], {"role": "assistant", "content": "great"}]} for r in user_turns]
    assert inspect_data(write_jsonl(tmp_path / "chats.jsonl", answered), tokenizer)["stage"] == "sft"


def test_cli_errors_are_one_line_with_exit_code_2(files, tmp_path, model_dir, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{oops\n')
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump({"model": str(model_dir("llama")), "output_dir": str(tmp_path / "o"), "data": {"train": str(bad)}}))
    cases = [
        (["sft", str(config)], "bad.jsonl:2: not valid JSON"),
        (["sft", str(config), f"data.train={files['pref']}"], "`ppokit sft` needs"),
        (["sft", str(config), f"model={tmp_path / 'missing'}", f"data.train={files['sft']}"], "does not exist"),
        (["rm", str(config), f"data.train={files['prompts']}"], "`ppokit rm` needs preference pairs"),
        (["data", "inspect", str(tmp_path / "none.csv")], "data file not found"),
        (["pipeline", str(config)], "known keys here: output_dir, sft, rm, ppo"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err  # progress lines may come first; the error is one line, last
        errors = [line for line in err.splitlines() if line.startswith("ppokit: error: ")]
        if argv[0] == "pipeline":  # two unknown keys: one a line, then the keys known there, the error's block last
            assert errors == ["ppokit: error: unknown config keys:"], (argv, err)
            block = err.splitlines()[err.splitlines().index(errors[0]):]
            assert [line.strip() for line in block[1:3]] == ["data", "model"] and block[-1] == expected, (argv, err)
        else:
            assert len(errors) == 1 and err.splitlines()[-1] == errors[0] and expected in errors[0], (argv, err)
        assert "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_careless_model_and_tokenizer_inputs_are_one_line(model_dir, files, tokenizer, demo_data, tmp_path, capsys):
    """Each was a traceback from inside torch/safetensors/transformers."""
    import shutil

    from transformers import PreTrainedTokenizerFast

    from ppokit.demos.tiny import word_tokenizer

    model = model_dir("llama")
    # A tokenizer with more tokens than the model has embeddings (another model's, or tokens added later).
    bigger = word_tokenizer([r["prompt"] + " " + r["completion"] for r in demo_data["sft"]] + [f"new{i}" for i in range(50)])
    bigger.save_pretrained(tmp_path / "bigger")
    new_words = write_jsonl(tmp_path / "new.jsonl", [{"prompt": "the movie was", "completion": "new7 ."}] * 8)
    # A tokenizer without an EOS token: sft cannot end completions with it.
    PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, pad_token="<pad>", unk_token="<unk>").save_pretrained(
        tmp_path / "no-eos")
    # A model folder whose weights file was cut short (an interrupted copy or download).
    shutil.copytree(model, tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    # A reward model where a causal LM belongs; the same without its tokenizer; a LoRA adapter folder.
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ppokit.models.loading import load_scalar_model

    load_scalar_model(str(model), "x").save_pretrained(tmp_path / "scorer")
    shutil.copytree(tmp_path / "scorer", tmp_path / "scorer-with-tokenizer")
    tokenizer.save_pretrained(tmp_path / "scorer-with-tokenizer")
    lora = LoraConfig(r=2, target_modules=["q_proj"])
    get_peft_model(AutoModelForCausalLM.from_pretrained(model), lora).save_pretrained(tmp_path / "adapter")
    same = write_jsonl(tmp_path / "same.jsonl", [{"prompt": "the movie was", "chosen": "good .", "rejected": "good ."}] * 8)
    config = _yaml(tmp_path, model, files["sft"])
    cases = [
        (["rm", str(config), f"data.train={same}", "data.eval_fraction=0"],
         f"ppokit: error: {same}: no training rows left after the length rule (0 of 8 prompts over max_prompt_length=256 "
         "truncated from the left, 0 completions cut at max_length=512, 8 rows dropped (8 of them pairs whose chosen and "
         "rejected are the same)); give pairs whose chosen and rejected completions differ"),
        (["sft", str(config), f"model={tmp_path / 'scorer-with-tokenizer'}"],
         f"ppokit: error: model: {tmp_path / 'scorer-with-tokenizer'} is a LlamaForSequenceClassification (a reward or "
         "value model), not a causal LM; its language-model head would be random. Give the SFT (or base) model here; "
         "a reward model goes in reward.model"),
        (["sft", str(config), f"model={tmp_path / 'scorer'}"],
         f"ppokit: error: tokenizer: {tmp_path / 'scorer'} holds a model but no tokenizer (no tokenizer_config.json, "
         "tokenizer.json or vocab files); set `tokenizer` to the folder or id of its tokenizer"),
        (["sft", str(config), f"model={tmp_path / 'adapter'}"],
         f"ppokit: error: model: {tmp_path / 'adapter'} holds a LoRA adapter for {model}, not a whole model; give the "
         "merged model (a LoRA PPO run writes final/merged/ with save_merged: true) or the base model"),
        (["sft", str(config), f"tokenizer={tmp_path / 'bigger'}", f"data.train={new_words}", "data.eval_fraction=0"],
         f"ppokit: error: {new_words}:1: token id {bigger.convert_tokens_to_ids('new7')} ('new7') is outside the model's "
         f"vocabulary of {len(tokenizer)} (vocab_size in its config): the tokenizer of {len(bigger)} tokens is not this "
         "model's; set `tokenizer` to the model's own, or resize the model's embeddings"),
        (["rm", str(config), f"tokenizer={tmp_path / 'no-eos'}", f"data.train={files['pref']}"],
         "ppokit: error: the tokenizer has no EOS token; every completion ends with EOS so that the model learns to stop: "
         "set the tokenizer's eos_token and save it again (or give another `tokenizer`)"),
        (["sft", str(config), f"model={tmp_path / 'cut'}"],
         f"ppokit: error: model: could not load '{tmp_path / 'cut'}': Error while deserializing header: invalid header "
         "length (a weights file is damaged or incomplete)"),
        (["data", "inspect", files["sft"], "--max-prompt-length", "0"],
         "ppokit data inspect: error: argument --max-prompt-length: expected a whole number > 0 or none, got 0"),
    ]
    for argv, expected in cases:
        with pytest.raises(SystemExit) if argv[0] == "data" else contextlib.nullcontext() as exited:
            assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.strip().splitlines()[-1] == expected, (argv, err)
        assert exited is None or exited.value.code == 2
    assert not (tmp_path / "o").exists()
    with pytest.raises(UserError, match="max_length must be a whole number > 0"):
        inspect_data(files["sft"], tokenizer, max_length=0)


def test_cli_data_inspect_prints_the_report(files, model_dir, capsys):
    assert main(["data", "inspect", files["sft"], "--tokenizer", str(model_dir("llama"))]) == 0
    out = capsys.readouterr().out
    assert "format         prompt_completion (detected from the columns)" in out
    assert "rows           400" in out and "example 3" in out and "0 rows dropped" in out
    # The whole sequence the stage trains on was labelled `completion_tokens`; it holds the prompt too.
    assert "completion_tokens" not in out and "  sequence: " in out
    assert "(sequence: the token ids the stage trains on, decoded: prompt + completion + EOS, after the length rule)" in out
    assert main(["data", "inspect", files["pref"], "--tokenizer", str(model_dir("llama")), "--json"]) == 0
    example = json.loads(capsys.readouterr().out)["examples"][0]
    assert example["chosen_sequence"] == f"{example['prompt']} {example['chosen']} <eos>"  # the word tokenizer's spacing and EOS


def test_data_inspect_and_the_stages_apply_one_length_rule(model_dir, tokenizer, tmp_path):
    """inspect's counts are the stage's: the same rows truncated, cut and dropped (a pair that
    cutting makes identical is dropped by rm, and inspect used to keep it)."""
    rows = preference_rows(24) + [
        # 3 prompt tokens leave 5: both completions cut to "great fun . great fun", identical.
        {"prompt": "the movie was", "chosen": "great fun . great fun .", "rejected": "great fun . great fun dull"},
        {"prompt": "the movie was " * 3, "chosen": "good .", "rejected": "bad ."},  # truncated to 8: no room, dropped
    ]
    pref = write_jsonl(tmp_path / "pref.jsonl", rows)
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows])
    limits = {"max_prompt_length": 8, "max_length": 8, "eval_fraction": 0.0}
    rm = run_rm(RMConfig.load(data={
        "model": str(model_dir("llama")), "output_dir": str(tmp_path / "rm"), "data": {"train": pref, **limits},
        "train": {"per_device_train_batch_size": 32},
    }), show_progress=False)
    inspected = inspect_data(pref, tokenizer, max_prompt_length=8, max_length=8)["length_rule"]
    assert rm["length_rule"]["train"] == inspected
    assert inspected["dropped"] == 2 and inspected["prompts_truncated"] == 1 and inspected["completions_cut"] >= 1
    config = sft_config(model_dir("llama"), sft, tmp_path / "sft", **limits)
    assert run_sft(config, show_progress=False)["length_rule"]["train"] == inspect_data(
        sft, tokenizer, max_prompt_length=8, max_length=8)["length_rule"]


def test_rows_over_the_models_position_limit_are_one_line_before_training(model_dir, files, tmp_path, capsys):
    """A GPT-2-style model with n_positions 8 and rows longer than that: one line naming the row,
    its length, the limit and the key to set, before any weights load (was an IndexError traceback)."""
    short = model_dir("gpt2", max_positions=8)
    config = _yaml(tmp_path, short, files["sft"])
    for argv in (["sft", str(config)], ["rm", str(config), f"data.train={files['pref']}"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        line = err.strip().splitlines()[-1]
        assert re.fullmatch(
            r"ppokit: error: .*\.jsonl:\d+: prompt \+ completion is \d+ tokens after the length rule, over the "
            r"model's position limit of 8 tokens \(n_positions in its config\); set data\.max_length to at most 8 "
            r"\(\d+ rows are over it\)", line), line
    assert main(["sft", str(config), "data.max_length=8", "train.num_train_epochs=0.1"]) == 0
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["steps"] > 0  # every row fits at max_length 8
    capsys.readouterr()
    # data inspect names them too, and takes several paths (a report each).
    assert main(["data", "inspect", files["sft"], files["pref"], files["prompts"], "--tokenizer", str(short)]) == 0
    out = capsys.readouterr().out
    reports = out.split("\nsource")
    assert len(reports) == 3 and [r.count("example 1") for r in reports] == [1, 1, 1]
    positions = [line for line in out.splitlines() if line.startswith("positions")]
    assert len(positions) == 3 and all("model limit 8 (n_positions):" in line for line in positions)
    assert "set data.max_length to at most 8" in positions[0] and "data.max_prompt_length" not in positions[0]
    assert main(["data", "inspect", files["prompts"], str(tmp_path / "none.jsonl"), "--json", "--tokenizer", str(short),
                 "--response-length", "4", "--max-prompt-length", "4"]) == 2
    captured = capsys.readouterr()
    (report,) = [json.loads(line) for line in captured.out.splitlines()]
    assert report["position_limit"] == {"tokens": 8, "key": "n_positions", "rows_over": 0, "first_over": None,
                                        "fix": "set data.max_prompt_length to at most 4 (it is 4)"}
    assert captured.err.strip() == f"ppokit: error: data file not found: {tmp_path / 'none.jsonl'}"


def test_rm_on_chat_preferences_without_a_prompt_column(model_dir, tmp_path):
    def chat(prompt, answer):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]

    rows = [{"chosen": chat(r["prompt"], r["chosen"]), "rejected": chat(r["prompt"], r["rejected"])} for r in preference_rows(64)]
    config = RMConfig.load(data={
        "model": str(model_dir("llama")), "output_dir": str(tmp_path / "rm"),
        "data": {"train": write_jsonl(tmp_path / "chat_pref.jsonl", rows), "eval_fraction": 0.25},
        "train": {"learning_rate": 1e-3, "per_device_train_batch_size": 16},
    })
    summary = run_rm(config, show_progress=False)
    assert summary["format"] == "preference" and summary["eval_pairs"] == 16
    assert "assistant:" in yaml.safe_load((tmp_path / "rm" / "config.yaml").read_text())["data"]["chat_template"]
    from transformers import AutoConfig

    saved = AutoConfig.from_pretrained(tmp_path / "rm")
    assert saved.num_labels == 1 and saved.pad_token_id is not None


def test_ppo_takes_chat_prompts_and_passes_columns_to_reward_functions(model_dir, tmp_path):
    from conftest import tiny_ppo_config

    from ppokit.trainer import PPOTrainer

    rows = [{"messages": [{"role": "user", "content": p}], "answer": i} for i, p in enumerate(OPENERS)]
    seen = {}

    def reward(prompts, completions, messages, answer, **rest):
        seen.update(prompts=prompts, messages=messages, answer=answer)
        return [1.0] * len(prompts)

    config = tiny_ppo_config(model_dir("llama"), write_jsonl(tmp_path / "chat.jsonl", rows), tmp_path / "run")
    config.data.eval_fraction = 0.2
    trainer = PPOTrainer(config, reward_functions=[reward], show_progress=False)
    assert len(trainer.train_data) == 16 and len(trainer.eval_data) == 4
    trainer.train()
    assert all(p.startswith("user: ") and p.endswith("\nassistant:") for p in seen["prompts"])
    assert all(isinstance(a, int) for a in seen["answer"]) and isinstance(seen["messages"][0], list)
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert "assistant:" in recorded["data"]["chat_template"]


def test_data_inspect_cuts_long_examples_and_reports_empty_cells(tmp_path, capsys):
    huge = tmp_path / "huge.jsonl"
    huge.write_text(json.dumps({"prompt": "the movie was " * 750_000}) + "\n")  # 10.5 MB
    assert main(["data", "inspect", str(huge)]) == 0
    out = capsys.readouterr().out
    assert len(out) < 2000 and "... (10500000 characters in all)" in out
    report = inspect_data(str(huge))
    assert report["lengths"]["prompt"]["max"] == 10_500_000 and len(report["examples"][0]["prompt"]) < 400

    table = tmp_path / "d.csv"
    table.write_text("prompt,completion\nthe movie,\nthe plot,was fine\n")
    assert main(["data", "inspect", str(table)]) == 0
    captured = capsys.readouterr()
    assert "empty cells    completion 1 (read as empty strings)" in captured.out
    assert f"ppokit: warning: {table}: 1 empty cell (column completion: line 2) read as empty strings" in captured.err


def test_sft_and_rm_train_with_a_pad_token_the_model_has_no_row_for(model_dir, files, tmp_path):
    """A `[PAD]` added to the tokenizer without resizing the embeddings: the stages pad with an id the
    model has (models.input_pad_id) and train as with the model's own pad token (masks are positional)."""
    from transformers import AutoTokenizer

    base = model_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    tokenizer.save_pretrained(tmp_path / "added-pad")
    summaries = {}
    for name in ("added-pad", "own-pad"):
        sft = sft_config(base, files["sft"], tmp_path / f"sft-{name}")
        rm = RMConfig.load(data={"model": str(base), "output_dir": str(tmp_path / f"rm-{name}"), "data": {"train": files["pref"]},
                                 "train": {"per_device_train_batch_size": 16, "learning_rate": 1e-3}})
        sft.tokenizer = rm.tokenizer = str(tmp_path / "added-pad") if name == "added-pad" else None
        summaries[name] = [run_sft(sft, show_progress=False), run_rm(rm, show_progress=False)]
    for added, own in zip(summaries["added-pad"], summaries["own-pad"]):
        for key in ("first_loss", "last_loss", "eval_loss"):  # masked positions add exact zeros
            assert added[key] == pytest.approx(own[key], rel=1e-6), key
