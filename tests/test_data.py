"""Data sources, format detection, chat rendering, the length rule, the eval split, and bad input."""

import csv
import re
import json

import pytest

from ppokit.conversation.templates import PLAIN_CHAT_TEMPLATE, Renderer
from ppokit.data.formats import load_records, preference_triples, sft_pairs, split_eval
from ppokit.data.sources import read_source
from ppokit.data.lengths import fit_lengths, tokenize_pair
from ppokit.data.prompts import as_prompt_dataset, render_chat_prompts
from ppokit.errors import UserError

CHAT = [
    {"messages": [{"role": "user", "content": "the movie was"}, {"role": "assistant", "content": "great fun ."}]},
    {"messages": [{"role": "system", "content": "be kind"}, {"role": "user", "content": "the plot was"}, {"role": "assistant", "content": "clever ."}]},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------- sources


ROWS = [{"prompt": "the movie was", "completion": "great ."}, {"prompt": "the plot was", "completion": "dull ."}]


def _write_every_kind(tmp_path):
    import datasets

    paths = {"jsonl": write_jsonl(tmp_path / "d.jsonl", ROWS)}
    paths["json"] = tmp_path / "d.json"
    paths["json"].write_text(json.dumps(ROWS))
    paths["json_columns"] = tmp_path / "cols.json"
    paths["json_columns"].write_text(json.dumps({"prompt": [r["prompt"] for r in ROWS], "completion": [r["completion"] for r in ROWS]}))
    paths["jsonl_named_json"] = tmp_path / "lines.json"
    paths["jsonl_named_json"].write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    paths["csv"] = tmp_path / "d.csv"
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["prompt", "completion"])
        writer.writeheader()
        writer.writerows(ROWS)
    dataset = datasets.Dataset.from_list(ROWS)
    paths["parquet"] = tmp_path / "d.parquet"
    dataset.to_parquet(str(paths["parquet"]))
    dataset.save_to_disk(str(tmp_path / "single"))
    paths["save_to_disk"] = tmp_path / "single"
    datasets.DatasetDict({"train": dataset, "test": dataset.select([0])}).save_to_disk(str(tmp_path / "dict"))
    paths["save_to_disk_dict"] = tmp_path / "dict"
    return paths


def test_every_local_source_reads_the_same_rows(tmp_path):
    for kind, path in _write_every_kind(tmp_path).items():
        records = load_records(str(path))
        assert records.rows == ROWS, kind
        assert records.format == "prompt_completion" and records.detected, kind
    test_split = load_records(f"{tmp_path / 'dict'}:test")
    assert test_split.rows == ROWS[:1]
    with pytest.raises(UserError, match="no split 'validation'; splits: train, test"):
        read_source(f"{tmp_path / 'dict'}:validation")


def test_hub_names_go_to_load_dataset_with_config_and_split(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, subset=None, split=None):
        calls.append((name, subset, split))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_records("someone/reviews").rows == ROWS
    load_records("someone/reviews@small:test")
    assert calls == [("someone/reviews", None, "train"), ("someone/reviews", "small", "test")]

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(UserError, match="no such local file or folder.*ConnectionError: no network"):
        load_records("someone/reviews")


def test_missing_local_file_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(UserError, match="data file not found: .*nope.jsonl"):
        load_records(str(tmp_path / "nope.jsonl"))


# --------------------------------------------------------------------------- formats


@pytest.mark.parametrize(
    "row, fmt",
    [
        ({"prompt": "p", "answer": 3}, "prompt"),
        ({"prompt": "p", "completion": "c"}, "prompt_completion"),
        (CHAT[0], "messages"),
        ({"instruction": "i", "input": "x", "output": "o"}, "alpaca"),
        ({"instruction": "i", "output": "o"}, "alpaca"),
        ({"prompt": "p", "chosen": "a", "rejected": "b"}, "preference"),
        ({"chosen": CHAT[0]["messages"], "rejected": CHAT[1]["messages"]}, "preference"),
    ],
)
def test_format_detected_from_columns(row, fmt):
    records = load_records([row])
    assert records.format == fmt
    assert fmt in records.describe() and "detected" in records.describe()


def test_format_override_reads_preference_rows_as_prompts():
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}]
    records = load_records(rows, format="prompt")
    assert records.format == "prompt" and not records.detected
    dataset = as_prompt_dataset(rows, format="prompt")
    assert dataset.prompts == ["p"] and dataset.columns == {"chosen": ["a"], "rejected": ["b"]}


def test_sft_pairs_for_each_format():
    assert sft_pairs(load_records([{"prompt": "p", "completion": "c"}])) == [("p", "c")]
    prompt, completion = sft_pairs(load_records([CHAT[1]]))[0]
    assert [m["role"] for m in prompt] == ["system", "user"] and completion == [{"role": "assistant", "content": "clever ."}]
    prompt, completion = sft_pairs(load_records([{"instruction": "rate it", "input": "the plot", "output": "good"}]))[0]
    assert prompt == [{"role": "user", "content": "rate it\n\nthe plot"}]
    assert completion == [{"role": "assistant", "content": "good"}]


def test_preference_with_message_lists_shares_the_prompt_prefix():
    user = {"role": "user", "content": "the movie was"}
    row = {"chosen": [user, {"role": "assistant", "content": "great"}], "rejected": [user, {"role": "assistant", "content": "dull"}]}
    prompt, chosen, rejected = preference_triples(load_records([row]))[0]
    assert prompt == [user] and chosen[0]["content"] == "great" and rejected[0]["content"] == "dull"


def test_ppo_prompts_from_chat_are_rendered_with_a_generation_prompt(tokenizer):
    dataset = as_prompt_dataset(CHAT)
    assert dataset.prompts == [None, None]
    assert dataset.columns["messages"] == [c["messages"] for c in CHAT]  # the reference answer reaches reward functions
    template = render_chat_prompts(tokenizer, None, dataset)
    assert template == PLAIN_CHAT_TEMPLATE  # the test tokenizer has no chat template
    assert dataset.prompts[0] == "user: the movie was\nassistant:"
    assert dataset.prompts[1] == "system: be kind\nuser: the plot was\nassistant:"


# --------------------------------------------------------------------------- rendering and lengths


def test_renderer_uses_the_tokenizers_template_and_strips_a_doubled_bos(tokenizer):
    from tokenizers import processors

    tok = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer.__class__.from_str(tokenizer.backend_tokenizer.to_str()),
                              pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}")
    renderer = Renderer(tok)
    prompt, completion = renderer.pair([{"role": "user", "content": "the movie was"}], "great .")
    assert prompt == "[user] the movie was [assistant]"  # the tokenizer adds <bos> itself
    assert completion == " great . "
    assert renderer.template_used == tok.chat_template
    assert tok(prompt)["input_ids"].count(tok.bos_token_id) == 1


def test_a_template_that_writes_no_message_content_is_refused(tokenizer, tmp_path):
    """`data.chat_template: chatml` (a name ppokit does not ship) is Jinja text that renders as the word itself: every
    prompt would train as "chatml". A template that writes no message's content is one line naming the key; one that
    writes it renders."""
    chat = [{"role": "user", "content": "the movie was"}]
    no_content = tmp_path / "fixed.jinja"
    no_content.write_text("{% for m in messages %}[{{ m['role'] }}]{% endfor %}")
    for template, shown in (("chatml", "'chatml'"), (str(no_content), repr(str(no_content)))):
        with pytest.raises(UserError, match=rf"^data.chat_template: {re.escape(shown)} writes no message's content"):
            Renderer(tokenizer, template).prompt(chat)
    assert Renderer(tokenizer, "{% for m in messages %}{{ m['content'] }}{% endfor %}").prompt(chat) == "the movie was"
    assert Renderer(tokenizer, "plain").prompt(chat) == "user: the movie was\nassistant:"


def test_tokenize_pair_appends_eos_once(tokenizer):
    prompt_ids, completion_ids = tokenize_pair(tokenizer, "the movie was", "great .")
    assert completion_ids[-1] == tokenizer.eos_token_id and completion_ids.count(tokenizer.eos_token_id) == 1
    _, again = tokenize_pair(tokenizer, "the movie was", "great . <eos>")
    assert again == completion_ids


def test_length_rule():
    p, c = list(range(10)), [100, 101, 102]
    assert fit_lengths(p, c, None, None) == ((p, c), False, False)
    assert fit_lengths(p, c, 4, None) == (([6, 7, 8, 9], c), True, False)  # prompt truncated from the left
    assert fit_lengths(p, c, 4, 6) == (([6, 7, 8, 9], [100, 101]), True, True)  # completion cut on the right
    assert fit_lengths(p, c, None, 10) == (None, False, False)  # no room for a completion token: dropped


def test_eval_split_is_a_seeded_shuffle_not_the_tail():
    items = list(range(100))
    train, held = split_eval(items, 0.1, seed=3)
    assert len(held) == 10 and sorted(train + held) == items
    assert held != items[-10:]
    assert split_eval(items, 0.1, seed=3) == (train, held)
    assert split_eval(items, 0.1, seed=4)[1] != held
    assert split_eval(items, 0.0, seed=3) == (items, [])
    with pytest.raises(UserError, match="holds out all 1 rows"):
        split_eval([1], 0.5, seed=0)


# --------------------------------------------------------------------------- bad input


def test_malformed_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "c", "completion": \n')
    with pytest.raises(UserError, match=r"bad\.jsonl:3: not valid JSON"):
        load_records(str(path))
    broken = tmp_path / "bad.json"
    broken.write_text('[\n{"prompt": "a"},\n{"prompt": }\n]')
    with pytest.raises(UserError, match=r"bad\.json:3: not valid JSON"):
        load_records(str(broken))


def test_row_missing_fields_names_row_fields_and_formats(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "c"}])
    with pytest.raises(UserError) as e:
        load_records(str(path))
    message = str(e.value)
    assert "d.jsonl:2" in message and "missing field(s) completion of the prompt_completion format" in message
    assert "formats accepted" in message and "prompt+chosen+rejected" in message
    with pytest.raises(UserError, match=r"row 1: missing field\(s\) prompt of the preference format"):
        load_records([{"chosen": "a", "rejected": "b"}])


def test_unknown_columns_and_wrong_types(tmp_path):
    with pytest.raises(UserError, match="cannot tell the data format from its columns \\(question\\); formats accepted"):
        load_records([{"question": "a"}])
    with pytest.raises(UserError, match="field completion must be a string or a list"):
        load_records([{"prompt": "a", "completion": 3}])
    user_turn = [{"role": "user", "content": "hi"}]
    with pytest.raises(UserError, match="field prompt must be a string or a list"):
        load_records([{"prompt": 7, "chosen": user_turn, "rejected": user_turn}])
    with pytest.raises(UserError, match="field messages must be a non-empty list"):
        load_records([{"messages": "hello"}])
    with pytest.raises(UserError, match="unknown format 'chat'"):
        load_records([{"prompt": "a"}], format="chat")


def test_empty_sources(tmp_path):
    for name, text in (("e.jsonl", "\n\n"), ("e.json", "[]"), ("e.csv", "prompt,completion\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(UserError, match="no rows"):
            load_records(str(tmp_path / name))


def test_csv_extra_values_and_message_cells(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('messages\n"[{""role"": ""user"", ""content"": ""hi""}, {""role"": ""assistant"", ""content"": ""yo""}]"\n')
    assert load_records(str(path)).format == "messages"
    path.write_text("prompt,completion\na,b,c\n")
    with pytest.raises(UserError, match=r"d\.csv:2: more values than the header"):
        load_records(str(path))


def test_wrong_data_for_the_stage_says_what_the_stage_needs():
    preference = load_records([{"prompt": "p", "chosen": "a", "rejected": "b"}])
    with pytest.raises(UserError, match="`ppokit sft` needs prompt\\+completion, messages or Alpaca.*preference.*ppokit rm"):
        sft_pairs(preference)
    prompts = load_records([{"prompt": "p"}])
    with pytest.raises(UserError, match="`ppokit rm` needs preference pairs: prompt, chosen and rejected.*prompt \\(detected"):
        preference_triples(prompts)
    with pytest.raises(UserError, match="last message must be the assistant's"):
        sft_pairs(load_records([{"messages": [{"role": "user", "content": "hi"}]}]))


def test_bytes_that_are_not_utf8_name_file_and_line(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_bytes(b'{"prompt": "a"}\n\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"d\.jsonl:3: not UTF-8 text \(byte 0xe9\); save the file as UTF-8"):
        load_records(str(jsonl))
    table = tmp_path / "d.csv"
    table.write_bytes(b"prompt,completion\nthe movie,was fine\n\xff\xfe,x\n")
    with pytest.raises(UserError, match=r"d\.csv:3: not UTF-8 text \(byte 0xff\)"):
        load_records(str(table))
    whole = tmp_path / "d.json"
    whole.write_bytes(b'[{"prompt": "a"},\n {"prompt": "\x80"}]')
    with pytest.raises(UserError, match=r"d\.json:2: not UTF-8 text \(byte 0x80\)"):
        load_records(str(whole))


def test_a_byte_order_mark_does_not_end_up_in_a_column_name(tmp_path):
    table = tmp_path / "excel.csv"
    table.write_bytes("prompt,completion\nthe movie,was fine\n".encode("utf-8-sig"))  # Excel's "CSV UTF-8"
    records = load_records(str(table))
    assert records.columns == ["completion", "prompt"] and records.format == "prompt_completion"
    lines = tmp_path / "bom.jsonl"
    lines.write_bytes('{"prompt": "the movie"}\n'.encode("utf-8-sig"))
    assert load_records(str(lines)).rows == [{"prompt": "the movie"}]


def test_a_null_field_is_called_null(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": None}])
    with pytest.raises(UserError) as e:
        load_records(str(path))
    assert str(e.value).startswith(f"{path}:2: field prompt is null; the prompt format needs a string")
    with pytest.raises(UserError, match=r"row 1: fields prompt, completion are null"):
        load_records([{"prompt": None, "completion": None}], format="prompt_completion")


def test_prompt_field_that_the_data_lacks_is_an_error_not_a_fall_back(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "the movie was", "label": 1}] * 3)
    with pytest.raises(UserError, match=r"data\.prompt_field is 'text' but the data has no such column \(columns: label, prompt\)"):
        as_prompt_dataset(str(path), prompt_field="text")
    some = write_jsonl(tmp_path / "some.jsonl", [{"text": "the movie was"}, {"question": "the plot"}])
    with pytest.raises(UserError, match=r"some\.jsonl:2: no field text \(data\.prompt_field\); the row has question"):
        as_prompt_dataset(str(some), prompt_field="text")
    both = write_jsonl(tmp_path / "both.jsonl", [{"text": "the movie was", "prompt": "other"}])
    with pytest.raises(UserError, match=r"both\.jsonl:1: data\.prompt_field is 'text' but the row also has a prompt column"):
        as_prompt_dataset(str(both), prompt_field="text")
    renamed = as_prompt_dataset(str(write_jsonl(tmp_path / "t.jsonl", [{"text": "the movie was", "label": 1}])), prompt_field="text")
    assert renamed.prompts == ["the movie was"] and renamed.columns == {"label": [1]}


def test_empty_csv_cells_are_counted_and_reported(tmp_path):
    table = tmp_path / "d.csv"
    table.write_text("prompt,completion,label\nthe movie,,1\nthe plot,was fine\n,was dull,0\n")
    with pytest.warns(UserWarning, match=re.escape(
        f"{table}: 3 empty cells (column completion: line 2; column label: line 3; column prompt: line 4) read as empty strings"
    )):
        rows = read_source(str(table))
    assert rows.empty_cells == {"completion": 1, "label": 1, "prompt": 1}
    assert rows.rows[1] == {"prompt": "the plot", "completion": "was fine", "label": ""}


def test_an_empty_prompt_is_found_at_data_time_with_its_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "the movie was"}\n\n{"prompt": "the plot was"}\n{"prompt": "  "}\n')
    with pytest.raises(UserError, match=re.escape(f"{path}:4: the prompt is empty")):
        as_prompt_dataset(str(path))
    with pytest.raises(UserError, match=re.escape("<list>: row 2: the prompt is empty")):
        as_prompt_dataset(["a prompt", ""])
    dataset = as_prompt_dataset(str(write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}])))
    assert dataset.where(2).endswith("ok.jsonl:3") and dataset.subset([2, 0]).where(0).endswith("ok.jsonl:3")


def test_prompt_data_refuses_eval_dataset_with_eval_fraction_before_reading_anything(tmp_path):
    """eval_dataset= and data.eval_fraction both choose the eval prompts: refused before the training data is read
    (here a path that does not exist, which would fail otherwise)."""
    from ppokit.config.schema import DataConfig
    from ppokit.data.prompts import load_prompt_data

    data = DataConfig(train=str(tmp_path / "missing.jsonl"), eval_fraction=0.5)
    with pytest.raises(UserError, match="data.eval_fraction holds out training prompts for evaluation, but eval_dataset is given too"):
        load_prompt_data(data, 0, eval_dataset=["an eval prompt"])
    train, evaluation = load_prompt_data(DataConfig(train="unused"), 0, ["a", "b"], ["c"])
    assert (train.prompts, evaluation.prompts) == (["a", "b"], ["c"])
    train, evaluation = load_prompt_data(DataConfig(eval_fraction=0.5), 0, ["a", "b", "c", "d"])
    assert len(train) == 2 and len(evaluation) == 2 and sorted(train.prompts + evaluation.prompts) == ["a", "b", "c", "d"]
