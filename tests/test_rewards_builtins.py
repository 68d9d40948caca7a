import pytest

from ppokit.config.schema import PPOConfig
from ppokit.errors import UserError
from ppokit.rewards import ScoringBatch, function_source
from ppokit.rewards.builtins import extract_answer, last_boxed, parse_number


def run(entry, completions, **columns):
    source = function_source(entry, "reward.functions[0]")
    return source.score(ScoringBatch([""] * len(completions), completions, columns)).tolist()


def test_sentiment_orders_positive_above_negative():
    good, bad = run("sentiment", ["a wonderful , lovely film", "an awful , boring film"])
    assert good > 0.5 and bad < -0.5


@pytest.mark.parametrize(
    "text, expected",
    [("1,234.5", 1234.5), ("-3/4", -0.75), ("\\frac{3}{4}", 0.75), ("\\dfrac{1}{2}", 0.5), ("50\\%", 50), ("$12", 12),
     ("1e3", 1000), (".5", 0.5), ("\\text{7}", 7), ("seven", None), ("", None), ("1/0", None), ("2+2", None)],
)
def test_parse_number_reads_numbers_without_eval(text, expected):
    value = parse_number(text)
    assert (value is None) if expected is None else float(value) == pytest.approx(expected)


def test_answer_extraction_order_boxed_then_hashes_then_last_number():
    assert last_boxed("so \\boxed{\\frac{1}{2}} and \\boxed{x^{2}}") == "x^{2}"
    assert extract_answer("work ... #### 72\nbye", "auto", "last_number") == "72"
    assert extract_answer("\\boxed{5} #### 6", "auto", "last_number") == "5"
    assert extract_answer("she has 3 apples, then 1,250 apples.", "auto", "last_number") == "1,250"
    assert extract_answer("no number here", "auto", "last_number") is None


def test_math_equivalence_compares_numbers_and_extracts_from_both_sides():
    completions = ["so the answer is \\boxed{0.5}", "#### 1,000", "it is 41 or maybe 42", "I do not know", "\\boxed{__import__('os')}"]
    answers = ["1/2", "The total is 1000. #### 1000", "42", "7", "3"]
    assert run("math_equivalence", completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_exact_match_normalises_text_and_numbers_and_takes_parameters():
    completions = ["\\boxed{Paris}", "  paris. ", "Lyon", "#### 3.0"]
    assert run("exact_match", completions, answer=["paris", "Paris", "Paris", "3"]) == [1.0, 1.0, 0.0, 1.0]
    strict = {"function": "exact_match", "case_sensitive": True, "answer_column": "gold", "on_wrong": -1}
    assert run(strict, ["\\boxed{Paris}", "paris"], gold=["Paris", "Paris"]) == [1.0, -1.0]


def test_exact_match_without_the_answer_column_names_it():
    with pytest.raises(UserError, match="no column 'answer'.*columns: topic"):
        run("exact_match", ["x"], topic=["t"])


def test_regex_and_format_from_config_mappings():
    assert run({"function": "regex", "pattern": r"\d+"}, ["it is 42", "none"]) == [1.0, 0.0]
    fmt = {"function": "format", "pattern": r"<think>.*</think>\s*<answer>.*</answer>"}
    assert run(fmt, ["<think>a\nb</think> <answer>4</answer>\n", "<answer>4</answer>", "x <think></think><answer>1</answer>"]) == [1.0, 0.0, 0.0]
    assert run({"function": "regex", "pattern": "GREAT", "ignore_case": True, "on_no_match": -0.5}, ["great", "bad"]) == [1.0, -0.5]


def test_contains_required_and_forbidden_whole_words():
    entry = {"function": "contains", "required": ["great", "fun"], "forbidden": ["boring"]}
    assert run(entry, ["great and fun", "great but boring", "greatest", "Great FUN , boring"]) == [1.0, -0.5, 0.0, 0.0]


def test_length_in_words_and_tokens_with_each_shape():
    words = {"function": "length", "target": 4, "unit": "words"}
    assert run(words, ["a b c d", "a b", "a b c d e f g h"]) == [0.0, -0.5, -1.0]
    assert run({**words, "side": "over"}, ["a b", "a b c d e f"]) == [0.0, -0.5]
    assert run({**words, "shape": "quadratic", "scale": 2}, ["a b"]) == [-1.0]
    assert run({**words, "shape": "gaussian"}, ["a b c d"]) == [1.0]
    tokens = function_source({"function": "length", "target": 2}, "k")
    batch = ScoringBatch(["p", "p"], ["x", "y"], completion_ids=[[5, 6], [5, 6, 7, 8]])
    assert tokens.score(batch).tolist() == [0.0, -1.0]
    with pytest.raises(UserError, match="unit: words"):
        tokens.score(ScoringBatch(["p"], ["x"]))


@pytest.mark.parametrize(
    "entry, message",
    [
        ("regex", r"reward.functions\[0\].pattern: required"),
        ({"function": "regex", "pattern": "("}, "not a valid regular expression"),
        ({"function": "regex", "pattern": "a", "patern": "b"}, r"unknown config key reward.functions\[0\].patern \(did you mean"),
        ({"function": "length", "target": -3}, r"reward.functions\[0\].target: value -3.0 is out of range, it must be > 0"),
        ({"function": "length", "target": 5, "unit": "lines"},
         r"reward.functions\[0\].unit: value 'lines' is out of range, it must be one of tokens, words, characters"),
        ({"function": "contains"}, "needs `required` or `forbidden`"),
        ({"function": "sentiment", "scale": 2}, "takes no parameters"),
        ({"pattern": "x"}, r"reward.functions\[0\].function: required"),
        ("nonsense", "expected a built-in"),
        (3, "expected a name or a mapping"),
        (":", r"reward function ':': expected a built-in"),
        ("my.py:", r"reward function 'my.py:': expected a built-in"),
        (":fn", r"reward function ':fn': expected a built-in"),
        ("  :  ", r"expected a built-in"),
        (".relative:fn", r"importing module .relative raised TypeError"),
    ],
)
def test_bad_entries_are_user_errors_naming_the_key(entry, message):
    with pytest.raises(UserError, match=message):
        function_source(entry, "reward.functions[0]")


def test_user_function_entry_gets_keyword_arguments(tmp_path):
    (tmp_path / "my_reward.py").write_text("def bonus(prompts, completions, amount, **columns):\n    return [amount] * len(completions)\n")
    source = function_source({"function": "my_reward.py:bonus", "name": "flat", "amount": 2.5}, "k", tmp_path)
    assert source.name == "flat"
    assert source.score(ScoringBatch(["p"], ["c"])).tolist() == [2.5]


def test_a_module_that_fails_or_exits_as_it_is_imported_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "breaks_on_import.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"importing .*exits_on_import.py raised SystemExit"):
        function_source("exits_on_import.py:fn", "k", tmp_path)
    with pytest.raises(UserError, match=r"importing module breaks_on_import raised RuntimeError: no GPU here"):
        function_source("breaks_on_import:fn", "k")


def test_file_function_that_is_missing_or_not_callable_says_which(tmp_path):
    (tmp_path / "my_reward.py").write_text("threshold = 3\n")
    with pytest.raises(UserError, match="has no function bonus"):
        function_source("my_reward.py:bonus", "k", tmp_path)
    with pytest.raises(UserError, match=r"threshold in .*my_reward.py is not a function \(its type is int\)"):
        function_source("my_reward.py:threshold", "k", tmp_path)


def test_serve_rm_argument_that_is_a_missing_directory_is_reported_as_one(tmp_path):
    from ppokit.rewards import source_from_argument

    with pytest.raises(UserError, match=f"reward model directory {tmp_path}/rm does not exist"):
        source_from_argument(f"{tmp_path}/rm")
    assert source_from_argument("sentiment").name == "sentiment"


def test_config_accepts_mappings_in_functions_and_checks_counts(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: m\nreward:\n  functions:\n    - sentiment\n    - {function: regex, pattern: 'x+'}\n"
        "  weights: [1.0, 0.5]\n  normalize: [true, false]\n  clip_range: [-2, 2]\n"
    )
    config = PPOConfig.load(path)
    assert config.reward.functions[1] == {"function": "regex", "pattern": "x+"}
    with pytest.raises(UserError, match="reward.normalize"):
        PPOConfig.load(path, ["reward.normalize=[true]"])
    with pytest.raises(UserError, match="reward.clip_range"):
        PPOConfig.load(path, ["reward.clip_range=[2, -2]"])
    with pytest.raises(UserError, match="reward.on_error"):
        PPOConfig.load(path, ["reward.on_error=ignore"])
    with pytest.raises(UserError, match="reward.remote.url: required"):
        PPOConfig.load(path, ["reward.remote={timeout_s: 3}", "reward.weights=null"])
    with pytest.raises(UserError, match="3 reward sources"):
        PPOConfig.load(path, ["reward.remote.url=http://127.0.0.1:1/"])


def test_every_builtin_and_parameter_is_documented():
    import dataclasses
    from pathlib import Path

    from ppokit.rewards.builtins import BUILTINS

    text = (Path(__file__).resolve().parents[1] / "docs" / "rewards.md").read_text()
    for name, builtin in BUILTINS.items():
        assert f"### `{name}`" in text or f"`{name}` and" in text or f"and `{name}`" in text, name
        for f in dataclasses.fields(builtin) if isinstance(builtin, type) else []:
            assert f"| `{f.name}` |" in text, (name, f.name)


def test_a_column_a_reward_function_needs_is_checked_before_any_model_loads(model_dir, prompts_file, tmp_path, monkeypatch):
    import ppokit.models.roles
    import ppokit.trainer
    from conftest import tiny_ppo_config

    from ppokit.errors import UserError

    def must_not_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the data's columns were checked")

    monkeypatch.setattr(ppokit.models.roles, "load_causal_lm", must_not_load)

    def needs_target(prompts, completions, target, weight=1.0, **columns):
        return [weight * (t in c) for t, c in zip(target, completions)]

    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run")
    with pytest.raises(UserError, match=r"reward function needs_target needs the data column\(s\) target, which data.train"):
        ppokit.trainer.PPOTrainer(config, reward_functions=[needs_target], show_progress=False)
    config.reward.functions = ["math_equivalence"]
    with pytest.raises(UserError, match=r"reward function math_equivalence needs the data column\(s\) answer"):
        ppokit.trainer.PPOTrainer(config, show_progress=False)
