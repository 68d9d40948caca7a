"""Multi-turn episodes: the episode loop's layout (which positions are trained), turn limits, the token
budget, turn reward placement, failures, and the loop over a real transformers engine."""

from __future__ import annotations

import math

import pytest
import torch
from request_engines import ScriptedRequests
from conftest import conversation_renderer

from ppokit.conversation.templates import PLAIN_CHAT_TEMPLATE
from ppokit.engines.base import Sampling
from ppokit.engines.hf import HFEngine
from ppokit.environments import EnvironmentRunner
from ppokit.training import experience
from ppokit.environments.episode_loop import EpisodeLoop
from ppokit.metrics.values import episode_metrics
from ppokit.models.forwards import response_logprobs
from ppokit.demos.tiny import tiny_causal_lm, word_tokenizer

WORDS = "guess the number from 1 to 16 : 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 higher lower correct user assistant"


@pytest.fixture(scope="module")
def game_tokenizer():
    return word_tokenizer([WORDS])


class ScriptedEngine(ScriptedRequests):
    """A rollout engine answering every context with the same tokens (-0.5 logprob each); `calls`: the contexts of
    each submit call (the requests ready at one moment)."""

    def __init__(self, answer: list[int], pad: int, stop: int):
        super().__init__()
        self.answer, self.pad_token_id, self.stop, self.calls = answer, pad, stop, self.submitted

    def respond(self, request):
        return self.answer, [-0.5] * len(self.answer)


class Script:
    """An environment replaying the (observation, reward, done) steps of its row's `plan`, after reset's `first`."""

    seen: list = []  # (row, completions) of every episode, in order

    def reset(self, row):
        self.steps, self.completions = [tuple(s) if isinstance(s, list) else s for s in row["plan"]], []
        Script.seen.append((row, self.completions))
        return row.get("first")

    def step(self, completion):
        self.completions.append(completion)
        return self.steps.pop(0)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_loop(tokenizer, engine, cls=None, **kw):
    args = dict(max_turns=3, max_episode_tokens=None, pad_token_id=tokenizer.pad_token_id)
    args.update(kw)
    Script.seen = []
    return EpisodeLoop(engine, tokenizer, EnvironmentRunner("script.py:Script", cls or Script, {}, timeout_s=None), **args)


def sampling(tokenizer, n=8):
    return Sampling(max_new_tokens=n, temperature=1.0, stop_token_ids=tokenizer.eos_token_id)


def test_hand_checked_episode_trains_only_the_model_tokens(game_tokenizer):
    tok = game_tokenizer
    eos, seven = tok.eos_token_id, ids(tok, "7")[0]
    engine = ScriptedEngine([seven, eos], tok.pad_token_id, eos)
    prompt = ids(tok, "guess the number")
    row = {"prompt": "guess the number", "first": "1 to 16", "plan": [("higher", 0.25, False), ("correct", 1.0, True)]}
    episodes = make_loop(tok, engine).sample([prompt], [row], sampling(tok))
    # response region: [1 to 16] (reset) 7 <eos> [higher] 7 <eos>; the final "correct" is not appended
    want = ids(tok, "1 to 16") + [seven, eos] + ids(tok, "higher") + [seven, eos]
    assert episodes.response_ids[0].tolist() == want
    assert episodes.loss_mask[0].tolist() == [False, False, False, True, True, False, True, True]
    assert episodes.attention_mask[0].tolist() == [True] * (len(prompt) + len(want))
    assert episodes.logprobs[0].tolist() == [0, 0, 0, -0.5, -0.5, 0, -0.5, -0.5]
    assert episodes.score_index.tolist() == [7]
    assert episodes.query_ids[0].tolist() == prompt and bool(episodes.ended[0])
    # each step's reward at the last token of the turn that earned it; the episode's reward is their sum
    assert episodes.turn_rewards[0].tolist() == [0, 0, 0, 0, 0.25, 0, 0, 1.0]
    assert episodes.environment_rewards.tolist() == [1.25] and episodes.turns.tolist() == [2] and episodes.done.tolist() == [True]
    assert episodes.model_tokens.tolist() == [4] and episodes.observation_tokens.tolist() == [4] and episodes.truncated.tolist() == [False]
    assert Script.seen == [(row, ["7", "7"])]
    # the second turn's context is the prompt and everything after it so far
    assert engine.calls[1] == [prompt + want[:6]]
    metrics = episode_metrics(episodes)
    assert metrics["rollout/turns"] == 2 and metrics["env/done_rate"] == 1
    # the transcript: every turn as text, marked with who spoke, a model turn with its step's reward and, the
    # last, that the environment ended the episode there (samples.jsonl's `turns`)
    assert episodes.transcripts == [[{"role": "user", "text": "1 to 16"}, {"role": "assistant", "text": "7", "reward": 0.25},
                                     {"role": "user", "text": "higher"}, {"role": "assistant", "text": "7", "reward": 1.0, "done": True}]]

    # rollout.turn_rewards: the environment's part of the score (weight 2 x 1.25) moves to the turns that earned it (stage 4)
    episodes.scores = torch.tensor([0.5 + 2.0 * 1.25])  # another source's 0.5 and the environment's, weighted
    episodes.ref_logprobs = episodes.logprobs + 0.1 * episodes.loss_mask  # a k1 KL of -0.1 on every model token
    settings = dict(kl_estimator="k1", kl_clamp=None, kl_coef=1.0, whiten=False)
    placed, _, _ = experience.rewards(episodes, turn_weight=2.0, **settings)
    assert placed[0].tolist() == pytest.approx([0, 0, 0, 0.1, 0.1 + 0.5, 0, 0.1, 0.1 + 0.5 + 2.0])
    whole, _, _ = experience.rewards(episodes, **settings)  # turn rewards off: the whole score at the last model token
    assert whole[0].tolist() == pytest.approx([0, 0, 0, 0.1, 0.1, 0, 0.1, 0.1 + 0.5 + 2.5])


def test_one_batched_generate_per_turn_and_max_turns(game_tokenizer):
    tok = game_tokenizer
    eos, seven = tok.eos_token_id, ids(tok, "7")[0]
    engine = ScriptedEngine([seven, eos], tok.pad_token_id, eos)
    # episode 0 is done after one turn, episode 1 after two, episode 2 never: max_turns=3 ends it
    plans = [[("correct", 1.0, True)], [("lower", 0.0, False), ("correct", 1.0, True)], [("higher", 0.0, False)] * 5]
    loop = make_loop(tok, engine, max_turns=3)
    prompt = ids(tok, "guess the number")
    episodes = loop.sample([prompt] * 3, [{"prompt": "p", "plan": plan} for plan in plans], sampling(tok))
    assert [len(c) for c in engine.calls] == [3, 2, 1]  # the unfinished episodes, batched
    assert episodes.turns.tolist() == [1, 2, 3] and episodes.done.tolist() == [True, True, False] and episodes.truncated.tolist() == [False] * 3
    assert episodes.loss_mask.sum(1).tolist() == [2, 4, 6]
    assert episodes.attention_mask[:, len(prompt):].sum(1).tolist() == [2, 5, 8]
    assert episode_metrics(episodes)["env/done_rate"] == pytest.approx(2 / 3)


def test_episode_metrics_are_means_over_every_process(game_tokenizer):
    """rollout/* and env/* add every process's sums and counts before dividing: with a fake all-reduce that
    doubles them (two processes with these same episodes) the means are unchanged, and a process's own
    sums are what it adds (sum and count, not its mean, go into the reduction)."""
    from ppokit.metrics.values import EPISODE_METRICS

    tok = game_tokenizer
    eos, seven = tok.eos_token_id, ids(tok, "7")[0]
    plans = [[("correct", 1.0, True)], [("lower", 0.0, False), ("correct", 1.0, True)], [("higher", 0.0, False)] * 5]
    loop = make_loop(tok, ScriptedEngine([seven, eos], tok.pad_token_id, eos), max_turns=3)
    episodes = loop.sample([ids(tok, "guess")] * 3, [{"prompt": "p", "plan": plan} for plan in plans], sampling(tok))
    reduced = []

    def doubled(sums):
        reduced.append(sums.clone())
        return sums * 2

    metrics = episode_metrics(episodes, doubled)
    assert len(reduced) == 1 and reduced[0].tolist() == [6, 12, 3, 0, 2, 3]  # turns, model/obs tokens, truncated, done, episodes
    assert set(metrics) == set(EPISODE_METRICS)
    assert metrics == episode_metrics(episodes)  # exact: small integer sums, the same division
    assert metrics["rollout/turns"] == 2 and metrics["env/done_rate"] == 2 / 3

    # a second process with other episodes: the means are over all of them, not a mean of means
    other = torch.tensor([1.0, 2.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)  # one episode: 1 turn, truncated, done
    together = episode_metrics(episodes, lambda sums: sums + other)
    assert together["rollout/turns"] == 7 / 4 and together["rollout/truncated"] == 1 / 4 and together["env/done_rate"] == 3 / 4


def test_token_budget_cuts_observations_and_turns(game_tokenizer):
    tok = game_tokenizer
    eos, seven = tok.eos_token_id, ids(tok, "7")[0]
    observation = "higher than 16"  # 3 tokens ("than" is unknown: one <unk>)
    prompt = ids(tok, "guess")

    def run(budget):
        engine = ScriptedEngine([seven, eos], tok.pad_token_id, eos)
        loop = make_loop(tok, engine, max_turns=5, max_episode_tokens=budget)
        return loop.sample([prompt], [{"prompt": "guess", "plan": [(observation, 0.0, False)] * 5}], sampling(tok))

    episodes = run(4)  # 7 <eos> + 2 of the observation's 3 tokens: cut, truncated
    assert episodes.response_ids[0].tolist() == [seven, eos] + ids(tok, observation)[:2]
    assert episodes.loss_mask[0].tolist() == [True, True, False, False]
    assert episodes.truncated.tolist() == [True] and episodes.turns.tolist() == [1] and not bool(episodes.ended[0])
    # the transcript shows the observation as the model read it, cut and marked so
    cut = tok.decode(ids(tok, observation)[:2], skip_special_tokens=True)
    assert episodes.transcripts[0][-1] == {"role": "user", "text": cut, "cut": True} and cut != observation
    episodes = run(6)  # 7 <eos> obs(3) + one token of the next turn, cut
    assert episodes.response_ids[0].tolist() == [seven, eos] + ids(tok, observation) + [seven]
    assert episodes.loss_mask[0].tolist() == [True, True, False, False, False, True]
    assert episodes.score_index.tolist() == [5] and episodes.truncated.tolist() == [True] and episodes.turns.tolist() == [2]
    episodes = run(None)  # no budget: five turns, four observations between them
    assert episodes.turns.tolist() == [5] and episodes.truncated.tolist() == [False] and episodes.attention_mask[0, 1:].sum() == 5 * 2 + 4 * 3


def test_environment_failures_are_the_episodes_own(game_tokenizer):
    tok = game_tokenizer
    eos, seven = tok.eos_token_id, ids(tok, "7")[0]
    engine = ScriptedEngine([seven, eos], tok.pad_token_id, eos)

    class Raises(Script):
        def step(self, completion):
            if self.steps[0] == "raise":
                raise KeyError("boom")
            return super().step(completion)

    plans = [[("higher", "lots", False)], ["raise"], [("correct", 1.0, True)]]
    loop = make_loop(tok, engine, Raises)
    rows = [{"prompt": name, "plan": plan} for name, plan in zip(["first", "second", "third"], plans)]
    episodes = loop.sample([ids(tok, "guess")] * 3, rows, sampling(tok))
    errors = episodes.environment_errors
    assert errors[0].startswith("environment script.py:Script: step returned the reward 'lots'") and "'first'" in errors[0]
    assert errors[1] == "environment script.py:Script: step raised KeyError: 'boom'; prompt 'second'"
    assert errors[2] is None
    assert torch.isnan(episodes.environment_rewards[:2]).all() and episodes.environment_rewards[2] == 1.0
    # what the environment said travels with its rows: selected rows keep their own failures and transcripts
    picked = episodes.select(torch.tensor([2, 0]))
    assert picked.environment_errors == [errors[2], errors[0]] and picked.transcripts == [episodes.transcripts[2], episodes.transcripts[0]]
    assert picked.environment_rewards[0] == 1.0 and picked.turns.tolist() == episodes.turns[[2, 0]].tolist()


def test_turn_rewards_refused_where_the_score_is_not_a_weighted_sum():
    """Refused when the config is read (`ppokit validate`, the plan, before any loading), not after the models load."""
    from ppokit.config.schema import PPOConfig
    from ppokit.errors import UserError

    def config(*overrides):
        return PPOConfig.load(None, ["model=m", "environment=envs.py:Env", "reward.functions=[length]", *overrides])

    assert config().turn_weight is None
    assert config("rollout.turn_rewards=true", "reward.weights=[1.0, 3.0]").turn_weight == 3.0
    assert config("rollout.turn_rewards=true").turn_weight == 1.0
    with pytest.raises(UserError, match="reward.clip_range"):
        config("rollout.turn_rewards=true", "reward.clip_range=[-1, 1]")
    with pytest.raises(UserError, match="reward.normalize on the environment"):
        config("rollout.turn_rewards=true", "reward.normalize=[false, true]")


def test_chat_observations_use_the_template(game_tokenizer):
    tok = game_tokenizer
    renderer = conversation_renderer(tok, PLAIN_CHAT_TEMPLATE, stop_token_ids=tok.eos_token_id)
    # plain template: "role: content\n" lines, "assistant:" as the generation prompt
    assert renderer.observation([], "higher", True).ids == ids(tok, "\nuser: higher\nassistant:")
    assert renderer.observation([{"role": "tool", "content": "4"}], "4", True).ids == ids(tok, "\ntool: 4\nassistant:")
    assert conversation_renderer(tok, None).observation([], "higher", True).ids == ids(tok, "higher")


def test_chat_reset_observation_is_the_next_user_message_of_the_prompt(game_tokenizer):
    """With chat data, prompt + reset's observation + model turn + step's observation is, token for token, what
    the template renders for [user prompt, user observation, assistant turn, user observation]: the prompt's
    generation prompt moves after the first observation (read, not trained on)."""
    tok = game_tokenizer
    eos, seven = tok.eos_token_id, ids(tok, "7")[0]

    def render(messages):
        return ids(tok, tok.apply_chat_template(messages, chat_template=PLAIN_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False))

    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    prompt = render([user("guess the number")])
    row = {"prompt": "guess the number", "first": "1 to 16", "plan": [("higher", 0.0, False), ("correct", 1.0, True)]}
    loop = make_loop(tok, ScriptedEngine([seven, eos], tok.pad_token_id, eos),
                     renderer=conversation_renderer(tok, PLAIN_CHAT_TEMPLATE, stop_token_ids=eos))
    episodes = loop.sample([prompt], [row], sampling(tok))
    whole = episodes.input_ids[0][episodes.attention_mask[0]].tolist()
    # the stop token ends the assistant turn where the plain template writes its newline (not written twice)
    want = render([user("guess the number"), user("1 to 16"), {"role": "assistant", "content": "7"}, user("higher")])
    assert whole == want[: want.index(seven) + 1] + [eos] + want[want.index(seven) + 1:] + [seven, eos]
    assert episodes.query_ids[0].tolist() == prompt[:-2]  # "assistant :" moved after the observation
    trained = episodes.response_ids[0][episodes.loss_mask[0]].tolist()
    assert trained == [seven, eos, seven, eos] and episodes.observation_tokens.tolist() == [len(whole) - len(prompt) + 2 - 4]


def metaspace_tokenizer():
    """One token per character with SentencePiece's word marker (tokenizers' Metaspace, as Llama 2's and Mistral's
    tokenizers have it): spaces read as "▁", and a "▁" prepended to every text tokenised, so a text's tokens depend on
    where it starts: "\nuser: higher" tokenised by itself begins with a "▁" it does not have inside a conversation."""
    import string

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(set(string.printable) | {"▁"}))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens([AddedToken("</s>", special=True), AddedToken("<pad>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", clean_up_tokenization_spaces=False)


def test_an_observation_has_the_tokens_it_has_in_the_whole_conversation():
    """Observations are tokenised at the token level: their ids are those the template's whole rendering has after the
    turn, not their text tokenised alone. With a tokenizer that prepends "▁" to each text (SentencePiece's Metaspace),
    the two differ by that "▁": here the context at turns 2 and 3 (the stop tokens aside: the plain template writes
    none) must be, token for token, the plain template's rendering of the conversation so far, tokenised whole."""
    from test_conversation import Answers, ForcedEngine

    tok = metaspace_tokenizer()
    stop = tok.eos_token_id
    renderer = conversation_renderer(tok, PLAIN_CHAT_TEMPLATE, stop_token_ids=stop)
    renderer.check(needs_tools=False, max_turns=3)
    turns = [" 8", " 12", " 10"]  # after the generation prompt "assistant:", as the template writes "assistant: 8"
    turn_ids = [tok(text, add_special_tokens=False)["input_ids"] + [stop] for text in turns]
    torch.manual_seed(0)
    engine = ForcedEngine(tiny_causal_lm("llama", tok, hidden=32, heads=2).eval(), turn_ids, tok.pad_token_id, stop)
    question = [{"role": "user", "content": "guess"}]
    prompt = tok(renderer.prompt(question), add_special_tokens=False)["input_ids"]
    loop = EpisodeLoop(engine, tok, EnvironmentRunner("answers.py:Answers", Answers, {}, timeout_s=None), max_turns=3,
                     max_episode_tokens=400, pad_token_id=tok.pad_token_id, renderer=renderer)
    episodes = loop.sample([prompt], [{"prompt": "guess"}], Sampling(max_new_tokens=40, temperature=1.0, stop_token_ids=stop))
    assert episodes.turns.tolist() == [3]
    messages = list(question)
    for k, reply in ((1, "higher"), (2, "lower")):
        messages += [{"role": "assistant", "content": turns[k - 1].strip()}, {"role": "user", "content": reply}]
        text = tok.apply_chat_template(messages, chat_template=PLAIN_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False)
        whole = tok(text, add_special_tokens=False)["input_ids"]
        assert tok(text[text.rindex("\nuser:"):], add_special_tokens=False)["input_ids"][0] == tok.convert_tokens_to_ids("▁")
        assert [i for i in engine.contexts[k][0] if i != stop] == whole, k


@pytest.fixture(scope="module")
def game_model(game_tokenizer):
    torch.manual_seed(0)
    return tiny_causal_lm("llama", game_tokenizer).eval()


class CountingEngine(HFEngine):
    """The hf engine, recording every request and completion."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requests, self.completions = [], []

    def submit(self, requests):
        self.requests += requests
        super().submit(requests)

    def step(self):
        done = super().step()
        self.completions += done
        return done


def test_loop_over_a_real_model_keeps_its_logprobs(game_tokenizer, game_model):
    """Over a real model, the logprobs the loop keeps for each model token are a fresh forward's over the
    whole episode (observations included): the contexts were assembled as the trainer will read them."""
    tok = game_tokenizer
    engine = CountingEngine(game_model, tok.pad_token_id, torch.device("cpu"), rows_per_forward=8)
    loop = make_loop(tok, engine, max_turns=3, max_episode_tokens=20)
    prompts = [ids(tok, "guess the number from 1 to 16 :"), ids(tok, "guess :")]
    plan = [("higher", 0.0, False), ("lower", 0.0, False), ("correct", 1.0, True)]
    torch.manual_seed(1)
    episodes = loop.sample(prompts, [{"prompt": "a", "plan": plan}, {"prompt": "b", "plan": plan}], sampling(tok, n=4))
    # one request per model turn; every turn after the first continues its episode's kept keys and values
    assert len(engine.requests) == len(engine.completions) == int(episodes.turns.sum())
    following = [r for r in engine.requests if r.continues is not None]
    assert len(following) == int(episodes.turns.sum()) - 2 and all(r.seed is not None for r in engine.requests)
    cached = {c.request_id: c.cached_tokens for c in engine.completions}
    assert all(cached[r.request_id] > 0 for r in following)
    assert (episodes.loss_mask <= episodes.attention_mask[:, episodes.query_ids.shape[1]:]).all()
    with torch.no_grad():
        fresh, _ = response_logprobs(game_model, episodes.input_ids, episodes.attention_mask.long(), episodes.response_ids,
                                     episodes.loss_mask, 1.0)
    mask = episodes.loss_mask
    assert (fresh[mask] - episodes.logprobs[mask]).abs().max() < 1e-4
    assert episodes.observation_tokens[0] > 0 and (episodes.model_tokens > 0).all()


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_environment_reward_is_a_source_whose_failures_follow_on_error(on_error):
    from ppokit.config.schema import RewardConfig
    from ppokit.rewards.environment import EnvironmentReward
    from ppokit.rewards import ScoringBatch, build_scorer
    from ppokit.rewards.sources import RewardError

    scorer = build_scorer(RewardConfig(functions=[lambda prompts, completions: [0.5] * len(prompts)], weights=[1.0, 2.0], on_error=on_error),
                          environment=EnvironmentReward())
    error = "environment g.py:Game: step raised KeyError: 'x'; prompt 'b'"
    batch = ScoringBatch(["a", "b", "c"], ["1", "2", "3"], environment_rewards=[1.0, float("nan"), -1.0],
                         environment_errors=[None, error, None])
    if on_error == "raise":
        with pytest.raises(RewardError, match="step raised KeyError"):
            scorer.score(batch)
        return
    with pytest.warns(UserWarning, match="step raised KeyError"):
        result = scorer.score(batch)
    assert result.valid.tolist() == [True, False, True]
    assert result.scores.tolist() == [0.5 + 2.0, 0.0, 0.5 - 2.0]
    assert scorer.metrics(result)["reward/environment"] == 0.0


def test_demo_game_sft_examples_train_the_guesses_only():
    from ppokit.demos.guess import sft_examples
    from ppokit.environments.guess import vocabulary

    tok = word_tokenizer([" ".join(vocabulary())])
    game = {"prompt": "guess a number from 1 to 16 .", "turns": [["8", "higher"], ["12", "lower"], ["10", "correct"]]}
    (ids, labels), = sft_examples(tok, [game])
    eos = tok.eos_token_id
    text = tok.convert_ids_to_tokens(ids)
    assert text == "guess a number from 1 to 16 . 8 <eos> higher 12 <eos> lower 10 <eos>".split()
    trained = [t for t, label in zip(text, labels) if label != -100]
    assert trained == ["8", "<eos>", "12", "<eos>", "10", "<eos>"] and labels[-1] == eos


CRITIC = '''
class Critic:
    """Answers every turn with words of the demo's vocabulary; rewards a turn by its length; done after 2 turns."""

    def reset(self, row):
        self.turns = 0
        return None

    def step(self, completion):
        self.turns += 1
        return "the movie was", float(len(completion.split()) % 3), self.turns >= 2
'''


def multi_turn_config(model_dir, prompts_file, out, env_file, **ppo):
    from conftest import tiny_ppo_config

    from ppokit.config.schema import RolloutConfig

    config = tiny_ppo_config(model_dir("llama"), prompts_file, out, **{"total_episodes": 32, "advantage_estimator": "grpo",
                                                                      "num_samples_per_prompt": 4, **ppo})
    config.environment = f"{env_file}:Critic"
    config.rollout = RolloutConfig(max_turns=3, max_episode_tokens=24)
    return config


def test_multi_turn_grpo_resumes_exactly_after_sigkill(model_dir, prompts_file, tmp_path):
    """A multi-turn grpo run killed mid-update and resumed writes the metrics of one that never stopped."""
    import signal

    from test_checkpoint import _cli, _wait_until, comparable, line_count

    from ppokit.run import checkpoint
    from ppokit.config.schema import PPOConfig
    from ppokit.trainer import PPOTrainer

    env_file = tmp_path / "critic.py"
    env_file.write_text(CRITIC)
    reference = tmp_path / "reference"
    records = PPOTrainer(multi_turn_config(model_dir, prompts_file, reference, env_file), show_progress=False).train()
    assert records[0]["rollout/turns"] == 2 and records[0]["rollout/observation_tokens"] > 0 and "reward/environment" in records[0]

    out, config_path, log = tmp_path / "run", tmp_path / "ppo.yaml", tmp_path / "stderr.txt"
    multi_turn_config(model_dir, prompts_file, out, env_file, save_steps=2).save(config_path)
    proc = _cli(config_path, log)
    _wait_until(lambda: line_count(out / "metrics.jsonl") >= 3, proc, log)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert checkpoint.find_checkpoint(None, out).name == "update-2"
    trainer = PPOTrainer(PPOConfig.load(config_path), show_progress=False)
    trainer.resume_from()
    trainer.train()
    assert comparable(out / "metrics.jsonl") == comparable(reference / "metrics.jsonl")
    assert (out / "samples.jsonl").read_text() == (reference / "samples.jsonl").read_text()


# The curve of a multi-turn grpo run: scores, KL, lengths, the loss statistics, the episodes' shape.
EPISODE_CURVE = ("objective/scores", "objective/kl", "objective/entropy", "objective/response_length", "policy/approxkl_avg",
                 "policy/clipfrac_avg", "loss/policy_avg", "policy/entropy_avg", "val/ratio", "rollout/turns",
                 "rollout/model_tokens", "rollout/observation_tokens", "reward/environment")


def _episode_run(model_dir, prompts_file, tmp_path, name, **switches):
    """2 updates of a multi-turn grpo run (2 turns, an observation between them), with `switches` set."""
    import json

    from conftest import with_speed_switches

    from ppokit.trainer import PPOTrainer

    env_file = tmp_path / "critic.py"
    env_file.write_text(CRITIC)
    lora = switches.pop("lora", None)
    config = with_speed_switches(multi_turn_config(model_dir, prompts_file, tmp_path / name, env_file, total_episodes=16), **switches)
    if lora is not None:
        from ppokit.config.schema import LoraConfig

        config.lora = LoraConfig(**lora)
    records = PPOTrainer(config, show_progress=False).train()
    samples = [json.loads(line) for line in (tmp_path / name / "samples.jsonl").read_text().splitlines()]
    return records, samples


@pytest.fixture(scope="module")
def plain_episode_run(model_dir, prompts_file, tmp_path_factory):
    return _episode_run(model_dir, prompts_file, tmp_path_factory.mktemp("episodes"), "plain")


@pytest.mark.parametrize("switch", [{"max_tokens_per_micro_batch": 64}, {"lm_head_chunk_size": 7}, {"lora": {}}],
                         ids=["token_budget", "light_head", "lora"])
def test_multi_turn_runs_hold_with_the_speed_switches_and_lora(model_dir, prompts_file, tmp_path, plain_episode_run, switch):
    """A multi-turn run trains with the token budget, the light head and LoRA: finite metrics, episodes of 2 turns
    with observation tokens between them (the loss mask's gaps). The token budget and the light head change only
    how the same sums are batched, so their curve is the plain run's within float rounding: after the first
    optimiser step a few-ulp difference (~1e-7 relative) goes through 2 updates of Adam at lr 1e-3 and the same
    sampled tokens; rel 1e-4 is far above that and far below what a wrong mask or a lost row moves (tests/test_speed.py)."""
    plain, plain_samples = plain_episode_run
    records, samples = _episode_run(model_dir, prompts_file, tmp_path, "switched", **switch)
    assert len(records) == len(plain) == 2
    for record in records:
        assert all(math.isfinite(record[key]) for key in EPISODE_CURVE), record
        assert record["rollout/turns"] == 2 and record["rollout/observation_tokens"] > 0
    if "lora" not in switch:
        for want, got in zip(plain, records):
            for key in EPISODE_CURVE:
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["update"], key)
    # samples.jsonl: each episode's transcript, turns marked, besides its completion text
    roles = [[t["role"] for t in row["turns"]] for row in plain_samples + samples]
    assert roles and all(r == ["assistant", "user", "assistant"] for r in roles)
    assert all(row["turns"][1]["text"] == "the movie was" for row in plain_samples)


# A multi-turn run under fsdp on two processes: tests/test_multiturn_trainer.py compares it with one process.
