"""Multi-turn behaviour checked through the trainer: real PPOTrainer runs of a tiny real model, asserting on what
reaches the update (the advantages of every trained token, the episodes' tokens the reward sources read), the
run's metrics and its timing, never on the internals that produce them. Each test names the breakage it is
there to catch (turn rewards not placed, environment calls one after another, max_calls ignored, a doubled stop
token at a ChatML turn end, a LoRA reference that is not the base), so that such a break fails here."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from chat_families import FAMILIES, trl_template
from conftest import tiny_ppo_config
from test_multiturn import CRITIC  # Critic: rewards a turn by its length (mod 3), answers "the movie was", done after 2 turns
from ppokit.training import algo
from ppokit.config.schema import RewardConfig, RolloutConfig
from ppokit.trainer import PPOTrainer

ONE_UPDATE = dict(total_episodes=8, per_device_train_batch_size=8, num_mini_batches=1, num_ppo_epochs=1, num_sample_generations=0)


def _config(model_dir, prompts_file, out, environment, rollout: dict, **ppo):
    config = tiny_ppo_config(model_dir("llama"), prompts_file, out, **{**ONE_UPDATE, **ppo})
    config.environment = environment
    config.reward = RewardConfig(functions=[])  # the environment's reward alone
    config.rollout = RolloutConfig(**rollout)
    return config


class LossInputs:
    """Records what reaches the policy loss: algo.ppo_loss's mask and advantages, per micro-batch."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        loss = algo.ppo_loss

        def recording(settings, normalisers, mask, logprobs, old_logprobs, advantages, *args, **kwargs):
            self.calls.append((mask.detach().clone(), advantages.detach().clone()))
            return loss(settings, normalisers, mask, logprobs, old_logprobs, advantages, *args, **kwargs)

        monkeypatch.setattr(algo, "ppo_loss", recording)

    def rows(self):
        """(trained mask, advantages) of every row that reached the loss."""
        return [(m, a) for mask, adv in self.calls for m, a in zip(mask, adv) if m.any()]


def spans(mask: torch.Tensor) -> list[list[int]]:
    """The columns of each run of True in a row's mask: the model's turns."""
    runs, previous = [], False
    for column, on in enumerate(mask.tolist()):
        if on and not previous:
            runs.append([])
        if on:
            runs[-1].append(column)
        previous = on
    return runs


# --------------------------------------------------------------------------- turn rewards reach the update


TURN_REWARDS_ENV = '''
class TwoSteps:
    """Step 1 rewards 1.0 and answers; step 2 rewards 3.0 and ends the episode."""
    def reset(self, row):
        self.turn = 0
        return None
    def step(self, completion):
        self.turn += 1
        return ("the movie was", 1.0, False) if self.turn == 1 else (None, 3.0, True)
'''


@pytest.mark.parametrize("turn_rewards", [True, False])
def test_turn_rewards_reach_the_update_at_the_turns_that_earned_them(turn_rewards, model_dir, prompts_file, tmp_path, monkeypatch):
    """reinforce_pp with gamma 1, no whitening and no KL in the reward: a token's advantage is the environment's reward
    still to come. Without a stop token every turn is response_length (4) tokens. With rollout.turn_rewards, the first
    turn's tokens get 1 + 3 = 4 and the second turn's 3; without, every token gets the episode's 4 at its end. The
    values are sums of small integers: exact. The policy loss of the one optimiser step (ratio 1, before it) is minus
    their mean, 3.5 against 4."""
    env = tmp_path / "env.py"
    env.write_text(TURN_REWARDS_ENV)
    config = _config(model_dir, prompts_file, tmp_path / "run", f"{env}:TwoSteps",
                     dict(max_turns=2, max_episode_tokens=16, turn_rewards=turn_rewards),
                     response_length=4, stop_token=None, advantage_estimator="reinforce_pp", whiten_advantages=False,
                     kl_in_reward=False, gamma=1.0)
    seen = LossInputs(monkeypatch)
    record = PPOTrainer(config, show_progress=False).step()
    assert record["rollout/turns"] == 2 and record["rollout/observation_tokens"] == 3 and record["reward/environment"] == 4
    rows = seen.rows()
    assert len(rows) == 8
    want = [4.0] * 4 + ([3.0] * 4 if turn_rewards else [4.0] * 4)
    for mask, advantages in rows:
        assert [len(s) for s in spans(mask)] == [4, 4]  # two turns, the observation between them not trained
        assert advantages[mask].tolist() == want
    assert record["loss/policy_avg"] == pytest.approx(-sum(want) / len(want), rel=1e-4)


# --------------------------------------------------------------------------- environment calls side by side


DEADLINE_S = 2.0
HUNG = 6  # of the 8 episodes

HANGING_ENV = '''
import threading

RELEASE = threading.Event()  # set by the test: the hung calls return, no thread outlives it

class HangsOnRequest:
    """A row with hang=True never answers the first turn (until released)."""
    def reset(self, row):
        self.hang = bool(row["hang"])
        return None
    def step(self, completion):
        if self.hang:
            RELEASE.wait(120)
        return None, 1.0, True
'''


def test_hung_episodes_cost_one_deadline_together_not_one_each(model_dir, prompts_file, tmp_path):
    """6 of 8 episodes hang in their first step, environment_timeout_s 2: their calls run side by side under one
    deadline, so the update's generation takes one deadline and the model's sampling (about 2 s, bounded below by 2 s
    and above by 2 + 3 deadlines); one after another they would take 6 deadlines (12 s). The hung episodes fail and
    leave the update (reward.on_error: skip); the other 2 train. The bound leaves 6 s for the sampling itself: a tenth
    of a second on a quiet machine."""
    env = tmp_path / "env.py"
    env.write_text(HANGING_ENV)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "the movie was", "hang": i < HUNG}) + "\n" for i in range(8)))
    config = _config(model_dir, rows, tmp_path / "run", f"{env}:HangsOnRequest", dict(max_turns=2), response_length=4)
    config.reward.on_error = "skip"
    config.environment_timeout_s = DEADLINE_S
    try:
        with pytest.warns(UserWarning, match="did not return within environment_timeout_s=2s"):
            record = PPOTrainer(config, show_progress=False).step()
    finally:
        for module in [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(env)]:
            module.RELEASE.set()
    assert record["reward/skipped"] == HUNG
    assert DEADLINE_S <= record["time/generation"] < DEADLINE_S + 3 * DEADLINE_S, record["time/generation"]


# --------------------------------------------------------------------------- a ChatML model that calls tools


QWEN = FAMILIES["qwen2_5"]  # Qwen2.5: its original template (ChatML, Hermes tool calls), its tokens, <|im_end|> ends a turn
TWO_CALLS = QWEN.call("tally", {}) + "\n" + QWEN.call("tally", {})
OVER_MAX_CALLS = "error: at most 1 tool calls run per turn; this one did not"
QUESTIONS = [f"count the {animal}" for animal in "cats dogs birds fish cows bees ants owls".split()]

TALLY_TOOL = '''
LOG = {log!r}

def tally() -> str:
    """Count one more."""
    with open(LOG, "a") as f:
        f.write("tally\\n")
    return "counted"
'''


def tally() -> str:
    """Count one more."""
    return "counted"  # the tool file's signature and docstring: the schema the environment gives the template


def tool_conversation(question: str, results: list[str]) -> list[dict]:
    return ([{"role": "user", "content": question}, {"role": "assistant", "content": TWO_CALLS}]
            + [{"role": "tool", "name": "tally", "content": r} for r in results] + [{"role": "assistant", "content": "done"}])


def qwen_tokenizer(texts: list[str]):
    """Qwen2.5's tokens (tests/chat_families.py) and template on a byte-level BPE whose merges are learnt from `texts`
    across spaces (no pre-split): the family's byte-per-token tokenizer makes a tool call ~40 tokens and a prompt with
    the tools' schemas ~700, which a tiny model learns slowly; here they are a few tokens and ~100."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, special_tokens=QWEN.special,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN.added])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=QWEN.stop, pad_token=QWEN.pad, clean_up_tokenization_spaces=False)
    tokenizer.chat_template = trl_template(QWEN.template)
    return tokenizer


@pytest.fixture(scope="module")
def chatml_model(tmp_path_factory):
    """A tiny llama taught (seconds of SFT) to answer any question with two tally calls, and "done" after the tools
    answered, in Qwen2.5's format; its tokenizer carries ChatML's tokens and Qwen2.5's original template. Prompts with
    and without the tools' schemas are both taught."""
    from ppokit.environments.tools import tool_schemas
    from ppokit.training.sft import encode_pair, train_sft
    from ppokit.demos.tiny import tiny_causal_lm

    schemas = tool_schemas({"tally": tally})
    conversations = [(tool_conversation(q, ["counted", OVER_MAX_CALLS]), tools) for q in QUESTIONS for tools in (None, schemas)]
    render = lambda tok, messages, tools, more=True: tok.apply_chat_template(  # noqa: E731
        messages, tools=tools, tokenize=False, add_generation_prompt=more)
    tok = qwen_tokenizer([render(QWEN.tokenizer(), c, tools, False) for c, tools in conversations])
    examples = []
    for conversation, tools in conversations:
        examples += [encode_pair(tok, render(tok, conversation[:1], tools), TWO_CALLS),
                     encode_pair(tok, render(tok, conversation[:4], tools), "done")]
    torch.manual_seed(0)
    model = tiny_causal_lm("llama", tok, max_positions=1024)
    train_sft(model, examples, tok.pad_token_id, epochs=12, batch_size=8, learning_rate=3e-3)
    path = tmp_path_factory.mktemp("chatml-model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


class RecordingSource:
    """A reward source (0 for every episode) that keeps the token ids of the episodes it scores."""

    name = "recording"

    def __init__(self):
        self.episodes: list[list[int]] = []

    def score(self, batch):
        for ids, mask in zip(batch.input_ids, batch.attention_mask):
            self.episodes.append(ids[mask.bool()].tolist())
        return torch.zeros(len(batch))


@pytest.fixture(scope="module")
def tool_run(chatml_model, tmp_path_factory):
    """One update of 8 episodes of the ChatML model with the Tools environment (max_calls 1), sampled greedily
    (top_k 1): what the reward source read, the samples' turns, and the tool's own log of its calls."""
    from ppokit.config.schema import DataConfig, PPOConfig, PPOHyperparams

    folder = tmp_path_factory.mktemp("tool-run")
    log = folder / "tally.log"
    (folder / "tally.py").write_text(TALLY_TOOL.format(log=str(log)))
    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": q}]}) + "\n" for q in QUESTIONS))
    config = PPOConfig(
        model=str(chatml_model), output_dir=str(folder / "run"), seed=1, reward=RewardConfig(functions=[]),
        data=DataConfig(train=str(data)),  # the tokenizer's own template
        ppo=PPOHyperparams(**{**ONE_UPDATE, "num_sample_generations": 1}, response_length=24, top_k=1, learning_rate=1e-3,
                           advantage_estimator="reinforce_pp"),
        environment="ppokit.environments:Tools",
        environment_args={"tools": [f"{folder / 'tally.py'}:tally"], "max_calls": 1, "timeout_s": 30},
        rollout=RolloutConfig(max_turns=3, max_episode_tokens=96),
    )
    source = RecordingSource()
    PPOTrainer(config, reward_functions=[source], show_progress=False).train()
    samples = [json.loads(line) for line in (folder / "run" / "samples.jsonl").read_text().splitlines()]
    return source.episodes, samples, log.read_text().splitlines() if log.exists() else []


def test_max_calls_runs_only_that_many_calls_of_a_turn(tool_run):
    """The model calls tally twice in its first turn; max_calls 1 runs the first and answers the second with an
    error text: 8 episodes, 8 calls run (16 if max_calls were ignored)."""
    from ppokit.environments import ToolCall, parse_tool_calls

    episodes, samples, calls_run = tool_run
    assert len(episodes) == 8 and len(samples) == 8
    for row in samples:
        first, *rest = row["turns"]
        assert first["role"] == "assistant" and parse_tool_calls(first["text"]) == [ToolCall("tally", {})] * 2  # the model called twice
        assert [(t["role"], t["text"]) for t in rest[:2]] == [("tool", "counted"), ("tool", OVER_MAX_CALLS)]
    assert len(calls_run) == 8


def test_an_episode_is_what_the_chat_template_renders_with_one_stop_token_per_turn(tool_run, chatml_model):
    """ChatML ends an assistant message with <|im_end|>, which is also the stop token the model's turn ended with: the
    episode holds it once, then the tool messages and the next generation prompt, exactly as Qwen2.5's template renders
    the whole conversation (the tools' schemas in its system message), every episode of the update, token for token as
    text (the byte-level tokenizer round-trips)."""
    from transformers import AutoTokenizer

    from ppokit.environments.tools import tool_schemas

    tok = AutoTokenizer.from_pretrained(chatml_model)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    episodes, samples, _ = tool_run
    for ids, row in zip(episodes, samples):
        assert all(not (a == b == end) for a, b in zip(ids, ids[1:])), tok.decode(ids)  # never <|im_end|><|im_end|>
        [question] = [q for q in QUESTIONS if q in row["prompt"]]
        messages = [{"role": "user", "content": question}] + [{"role": t["role"], "content": t["text"]} for t in row["turns"]]
        last = row["turns"][-1]
        assert (last["role"], last["text"], last.get("done")) == ("assistant", "done", True)  # the model's stop token ended it
        rendered = tok.apply_chat_template(messages, tools=tool_schemas({"tally": tally}), tokenize=False)
        assert tok.decode(ids, skip_special_tokens=False) == rendered.removesuffix("\n")  # the template's last newline follows no stop


# --------------------------------------------------------------------------- LoRA and FSDP against a plain reference

# What one update's record says about its episodes, their rewards and the first optimiser step.
COMPARED = ("objective/scores", "objective/kl", "objective/non_score_reward", "objective/entropy", "rollout/turns",
            "rollout/model_tokens", "rollout/observation_tokens", "reward/environment", "loss/policy_avg", "policy/entropy_avg",
            "val/ratio")


UNEVEN_CRITIC = '''
class UnevenCritic:
    """Rewards a turn by its length (mod 3); an episode is 1 or 2 turns by its prompt's length, so the processes' shares
    of a batch hold different numbers of trained tokens (and turns)."""
    def reset(self, row):
        self.turns, self.last = 0, 1 + len(row["prompt"]) % 2
        return None
    def step(self, completion):
        self.turns += 1
        return "the movie was", float(len(completion.split()) % 3), self.turns >= self.last
'''


def _critic_config(model_dir, prompts_file, out, env, name="Critic", **ppo):
    """reinforce_pp (the KL to the reference in the reward, whitened over the whole batch) over episodes of at most 2
    turns, sampled greedily (top_k 1: the same tokens whatever the random stream), one optimiser step per update."""
    return _config(model_dir, prompts_file, out, f"{env}:{name}", dict(max_turns=2, max_episode_tokens=24),
                   **{"advantage_estimator": "reinforce_pp", "whiten_advantages": False, "top_k": 1, "kl_coef": 0.5, **ppo})


@pytest.fixture
def eight_prompts(tmp_path, demo_data):
    """8 prompts: every update of 8 episodes takes each once (in another order)."""
    path = tmp_path / "eight.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in demo_data["prompts"][:8]))
    return path


def test_a_lora_multi_turn_update_is_the_full_weight_update_of_its_merged_weights(model_dir, eight_prompts, tmp_path):
    """LoRA's reference is its base with the adapters off. After one LoRA update, the second is compared with a
    full-weight trainer whose policy is the LoRA policy merged and whose reference is the base model: the same
    episodes (greedy), the same KL to the reference in the reward, the same first-step loss. The adapters' forward
    (W x + B A x) and the merged one ((W + B A) x) differ by float32 rounding, ~1e-6 relative; the KL is ~1e-2."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppokit.config.schema import LoraConfig

    env = tmp_path / "env.py"
    env.write_text(CRITIC)
    lora = _critic_config(model_dir, eight_prompts, tmp_path / "lora", env, total_episodes=16, learning_rate=2e-2)
    lora.lora = LoraConfig()
    trainer = PPOTrainer(lora, show_progress=False)
    first = trainer.step()
    assert first["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # the adapters start at zero: policy = reference
    merged = copy.deepcopy(trainer.policy).merge_and_unload().requires_grad_(True)  # the base's weights were frozen under LoRA
    second = trainer.step()

    full = _critic_config(model_dir, eight_prompts, tmp_path / "full", env, learning_rate=2e-2)
    base = AutoModelForCausalLM.from_pretrained(model_dir("llama"))
    reference = PPOTrainer(full, model=merged, ref_model=base, tokenizer=AutoTokenizer.from_pretrained(model_dir("llama")),
                           show_progress=False).step()
    assert abs(second["objective/kl"]) > 1e-2, second["objective/kl"]  # the policy moved away from its base
    for key in COMPARED:
        assert second[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-5), key


def test_a_multi_turn_fsdp_run_on_two_processes_is_the_one_process_run(model_dir, eight_prompts, tmp_path):
    """2 processes under fsdp (4 episodes each) against one process (8): the same greedy episodes, the loss normalised
    over the whole minibatch of every process (ppo.max_tokens_per_micro_batch), so the same gradient up to the order of
    float32 sums. Episodes of 1 or 2 turns (`UnevenCritic`): the processes hold different numbers of trained tokens, so
    a loss normalised by each process's own tokens, or episode metrics that are one process's means, would differ.
    Both updates' records (the second after a sharded optimiser step) and the final weights agree to float32 rounding
    carried through 2 Adam steps at lr 1e-3: rel 1e-4, atol 1e-5 (tests/test_multiprocess.py's ddp/fsdp bound)."""
    from test_multiprocess import TORCHRUN, _launch, _records
    from transformers import AutoModelForCausalLM

    if TORCHRUN is None:
        pytest.skip("torchrun is not on PATH")
    env = tmp_path / "env.py"
    env.write_text(UNEVEN_CRITIC)
    settings = dict(total_episodes=16, max_tokens_per_micro_batch=256, num_sample_generations=0)
    one = _critic_config(model_dir, eight_prompts, tmp_path / "one", env, "UnevenCritic", **settings)
    PPOTrainer(one, show_progress=False).train()
    two = _critic_config(model_dir, eight_prompts, tmp_path / "two", env, "UnevenCritic", per_device_train_batch_size=4, **settings)
    two.parallel.strategy = "fsdp"
    two.save(tmp_path / "two.yaml")
    result = _launch(tmp_path / "two.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    ones, twos = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert [(r["update"], r["episode"]) for r in twos] == [(1, 8), (2, 16)]
    assert abs(twos[1]["objective/kl"]) > 1e-3  # the second update samples from trained weights
    for a, b in zip(ones, twos):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (a["update"], key)
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "final").state_dict()
    for name, weight in AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "final").state_dict().items():
        assert torch.allclose(weight, trained[name], atol=1e-5), name


# --------------------------------------------------------------------------- an environment that changes directory


WANDERING_ENV = '''
import os

os.chdir({elsewhere!r})  # on import, while the trainer is set up


class Wanders:
    """One turn, rewarded 1; every episode changes the working directory again."""
    def reset(self, row):
        os.chdir({elsewhere!r})
        return None
    def step(self, completion):
        return None, 1.0, True
'''


def test_a_trainer_s_relative_output_dir_stays_where_it_was_when_the_environment_changes_directory(model_dir, prompts_file,
                                                                                                    tmp_path, monkeypatch):
    """PPOTrainer used as a library with output_dir `run` (relative): the environment's os.chdir (on import, in the
    trainer's set-up, and in every episode) moves nothing, its trackers' files included: the run folder is resolved
    once, when the trainer is made."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = tmp_path / "wanders.py"
    env.write_text(WANDERING_ENV.format(elsewhere=str(elsewhere)))
    monkeypatch.chdir(tmp_path)
    config = _config(model_dir, prompts_file, "run", f"{env}:Wanders", dict(max_turns=1), response_length=4)
    config.report_to = ["tensorboard"]
    PPOTrainer(config, show_progress=False).train()
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) == 1
    assert (run / "trackers.json").is_file() and (run / "tensorboard").is_dir()
    assert (run / "checkpoints" / "update-1").is_dir() and (run / "final" / "model.safetensors").is_file()
    assert list(elsewhere.iterdir()) == []
