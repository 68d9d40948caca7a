"""An agent's episode of several segments (docs/agents.md, "Episodes of several segments"): every segment trains as a row
of its own, the episode's reward on its last segment only, its advantage computed over its segments together (GRPO's
groups of episodes, GAE bootstrapping an earlier segment's end from the next one's value) and given to every row, its
rows kept together in the optimisation and weighed as one episode. The layout functions (`training/segments.py`) by
hand and against plain loops; the estimators against the per-episode computation; the trainer's update and
`ppokit ppo` with an agent that rewrites its history."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from ppokit.training import algo, segments

# --------------------------------------------------------------------------- the layout functions, by hand


def test_episode_layout_gather_and_scatter_by_hand():
    # rows 0 and 1 are episodes 0 and 1 (their last segments); row 2 is episode 0's earlier segment (rank before row 0's)
    mask = torch.tensor([[True, True, False], [True, False, False], [False, True, True]])
    row, column, real = segments.episode_layout(mask, torch.tensor([0, 1, 0]), torch.tensor([3, 3, 2]), 2)
    assert row.tolist() == [[2, 2, 0, 0], [1, 0, 0, 0]]
    assert column.tolist() == [[1, 2, 0, 1], [0, 0, 0, 0]]
    assert real.tolist() == [[True, True, True, True], [True, False, False, False]]
    values = torch.arange(9.0).reshape(3, 3)
    assert segments.gather(values, row, column, real).tolist() == [[7.0, 8.0, 0.0, 1.0], [3.0, 0.0, 0.0, 0.0]]
    back = segments.scatter(torch.tensor([[10.0, 20.0, 30.0, 40.0], [50.0, 9.0, 9.0, 9.0]]), row, column, real, (3, 3))
    assert back.tolist() == [[30.0, 40.0, 0.0], [50.0, 0.0, 0.0], [0.0, 10.0, 20.0]]


def test_episode_layout_matches_a_plain_loop():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        rows, width, count = 7, 5, 3
        mask = torch.rand(rows, width, generator=generator) < 0.5
        episode = torch.randint(0, count, (rows,), generator=generator)
        rank = torch.randperm(rows, generator=generator)
        values = torch.randn(rows, width, generator=generator)
        layout = segments.episode_layout(mask, episode, rank, count)
        got = segments.gather(values, *layout)
        for e in range(count):
            mine = sorted((r for r in range(rows) if episode[r] == e), key=lambda r: rank[r].item())
            want = [values[r, c].item() for r in mine for c in range(width) if mask[r, c]]
            assert got[e, : len(want)].tolist() == want and not got[e, len(want):].any()
            assert layout[2][e].sum().item() == len(want)
        assert torch.equal(segments.scatter(got, *layout, (rows, width)), values * mask)


def test_rows_of_chunks_and_shares_by_hand():
    episode = torch.tensor([0, 1, 0, 2, 1])
    rows = segments.rows_of(torch.tensor([1, 0]), episode)
    assert rows.tolist() == [1, 4, 0, 2]  # episode 1's rows, then episode 0's
    assert [c.tolist() for c in segments.episode_chunks(rows, episode, 1)] == [[1, 4], [0, 2]]
    assert [c.tolist() for c in segments.episode_chunks(rows, episode, 2)] == [[1, 4, 0, 2]]
    assert [c.tolist() for c in segments.episode_chunks(segments.rows_of(torch.tensor([2, 0, 1]), episode), episode, 2)] == [[3, 0, 2], [1, 4]]
    mask = torch.tensor([[True, True, False], [True, False, False], [True, True, True], [False, False, False]])
    shares = segments.row_shares(mask, torch.tensor([0, 1, 0, 1]))
    assert shares.tolist() == pytest.approx([2 / 5, 1.0, 3 / 5, 0.0], abs=1e-7)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_an_episode_of_two_rows_weighs_as_the_same_tokens_in_one_row(aggregation):
    # episode A's 5 tokens as rows of 2 and 3 tokens (with episode B's 4 in one row) against A in one row of 5
    split = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    whole = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.bool)
    loss_split = torch.tensor([[1.0, 2.0, 0, 0, 0], [3.0, 4.0, 5.0, 0, 0], [6.0, 7.0, 8.0, 9.0, 0]])
    loss_whole = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0, 0]])
    share = segments.row_shares(split, torch.tensor([0, 0, 1]))

    def loss(per_token, mask, row_share):
        weights = algo.token_weights(mask, aggregation, row_share)
        return algo.aggregate(per_token, weights, algo.loss_normalisers(mask, aggregation, 8, row_share).policy)

    by_hand = {"token_mean": 45 / 9, "seq_mean_token_sum": (15 + 30) / 2, "seq_mean_token_mean": (15 / 5 + 30 / 4) / 2,
               "seq_mean_token_sum_norm": (15 + 30) / (2 * 8)}[aggregation]
    eps = torch.finfo(torch.float32).eps * 45
    assert loss(loss_split, split, share).item() == pytest.approx(by_hand, abs=eps)
    assert loss(loss_whole, whole, None).item() == pytest.approx(by_hand, abs=eps)


# --------------------------------------------------------------------------- the estimators on the episodes


def two_segment_episodes(score: list[float], values: bool = False):
    """Episodes of 3 episodes (rows 0-2) where episode 0 has an earlier segment (row 3): its tokens a, b (row 3) then c,
    d (row 0); the scores at each episode's last token; values 0.1, 0.2, ... on the trained tokens."""
    from ppokit.training.episodes import Episodes, Span, pack

    spans = [[Span([5, 6], [0.0, 0.0])], [Span([5, 6, 7], [0.0] * 3)], [Span([5], [0.0])], [Span([8], None), Span([5, 6], [0.0, 0.0])]]
    episodes: Episodes = pack([[1, 2], [1, 2], [1, 2], [3]], spans, [True] * 4, 0)
    episodes.episode_index = torch.tensor([0, 1, 2, 0])
    episodes.scores = torch.tensor(score + [0.0])
    kl = torch.zeros_like(episodes.logprobs)
    episodes.rewards = algo.shape_rewards(episodes.scores, kl, episodes.trained_mask, 0.0, episodes.score_index)[0]
    if values:
        episodes.values = torch.arange(1, episodes.loss_mask.numel() + 1, dtype=torch.float32).reshape(episodes.loss_mask.shape) / 10
        episodes.values = episodes.values * episodes.loss_mask
    return episodes


def test_grpo_gives_every_row_of_an_episode_the_episodes_advantage():
    from ppokit.training import experience
    from ppokit.training.estimators import ESTIMATORS

    episodes = two_segment_episodes([1.0, 0.0, 0.5])
    adv, returns = experience.advantages(ESTIMATORS["grpo"], episodes, gamma=1.0, lam=1.0, whiten=False, group_size=3,
                                         grpo_scale_std=True, all_reduce=None)
    # the group's scores 1, 0, 0.5: mean 0.5, std 0.5 (unbiased) -> 1, -1, 0 on every trained token of each episode's rows
    want = algo.grpo_advantages(torch.tensor([1.0, 0.0, 0.5]), torch.ones(3, dtype=torch.bool), 3, True)
    assert want.tolist() == pytest.approx([1.0, -1.0, 0.0], abs=4e-6) and returns is None  # std + 1e-6 in the denominator
    for row, e in enumerate([0, 1, 2, 0]):
        mask = episodes.loss_mask[row]
        assert adv[row][mask].tolist() == [want[e].item()] * int(mask.sum()) and not adv[row][~mask].any()


def test_gae_bootstraps_an_earlier_segments_end_from_the_next_segments_value():
    from ppokit.training import experience
    from ppokit.training.estimators import ESTIMATORS

    episodes = two_segment_episodes([1.0, 0.0, 0.5], values=True)
    adv, returns = experience.advantages(ESTIMATORS["gae"], episodes, gamma=1.0, lam=1.0, whiten=False, group_size=1,
                                         grpo_scale_std=True, all_reduce=None)
    # gamma = lam = 1: A_t = (the rewards from t to the episode's end) - V_t; episode 0's four tokens (row 3's, then row 0's)
    # all see its reward 1, its earlier segment's included
    v = episodes.values
    assert adv[3][episodes.loss_mask[3]].tolist() == pytest.approx([1 - v[3, 1].item(), 1 - v[3, 2].item()], abs=1e-6)
    assert adv[0][:2].tolist() == pytest.approx([1 - v[0, 0].item(), 1 - v[0, 1].item()], abs=1e-6)
    assert returns[3][episodes.loss_mask[3]].tolist() == pytest.approx([1.0, 1.0], abs=1e-6)
    assert adv[1][:3].tolist() == pytest.approx([-v[1, t].item() for t in range(3)], abs=1e-6)


@pytest.mark.parametrize("name", ["gae", "grpo", "rloo", "reinforce_pp", "remax"])
def test_every_estimator_on_segment_rows_is_its_computation_on_each_episodes_tokens_in_call_order(name):
    """The rows' advantages equal the estimator run on one row per episode holding its segments' trained tokens in call
    order (built here by plain loops), token for token."""
    from ppokit.training import experience
    from ppokit.training.estimators import ESTIMATORS

    episodes = two_segment_episodes([1.0, 0.0, 0.5], values=True)
    episodes.baseline_scores = torch.tensor([0.25, 0.25, 0.25, 0.25])
    rows_of_episode = {0: [3, 0], 1: [1], 2: [2]}  # call order
    tokens = {e: [(r, c) for r in rows for c in range(episodes.loss_mask.shape[1]) if episodes.loss_mask[r, c]] for e, rows in rows_of_episode.items()}
    width = max(len(t) for t in tokens.values())

    def per_episode(x):
        out = torch.zeros(3, width)
        for e, where in tokens.items():
            for t, (r, c) in enumerate(where):
                out[e, t] = x[r, c]
        return out

    mask = torch.tensor([[t < len(tokens[e]) for t in range(width)] for e in range(3)])
    inputs = dict(gamma=0.9, lam=0.8, whiten=False, group_size=3, grpo_scale_std=True, all_reduce=None)
    want, want_returns = ESTIMATORS[name].advantages(per_episode(episodes.rewards), mask, values=per_episode(episodes.values),
                                                     baseline_scores=episodes.baseline_scores[:3], **inputs)
    adv, returns = experience.advantages(ESTIMATORS[name], episodes, **inputs)
    for e, where in tokens.items():
        for t, (r, c) in enumerate(where):
            assert adv[r, c].item() == want[e, t].item()
            if want_returns is not None:
                assert returns[r, c].item() == want_returns[e, t].item()
    assert not adv[~episodes.loss_mask].any()


def test_segment_rows_under_several_fsdp_processes_are_refused_in_one_line():
    from ppokit.errors import UserError
    from ppokit.training import experience
    from ppokit.training.episodes import EnvironmentSaid, SegmentRow, Span, pack

    said = [EnvironmentSaid(True, False, numbers={"agent/calls": 2.0}, earlier=[SegmentRow([4], [Span([5], [0.0])])])]
    episodes = pack([[1, 2]], [[Span([5, 6], [0.0, 0.0])]], [True], 0, environment=said)
    scored = experience.Scored(torch.tensor([1.0]), torch.tensor([True]), [], ["x"], {}, {})
    rows = experience.with_scores(episodes, scored, 0, lambda t: t)
    assert rows.episode_index.tolist() == [0, 0] and rows.scores.tolist() == [1.0, 0.0] and rows.valid.tolist() == [True, True]
    episodes = pack([[1, 2]], [[Span([5, 6], [0.0, 0.0])]], [True], 0, environment=said)
    with pytest.raises(UserError, match=r"^agent: 2 earlier segments .* 2 processes under parallel.strategy fsdp do not do yet") as raised:
        experience.with_scores(episodes, scored, 0, lambda t: t * 2, uneven_forwards=False)
    assert "\n" not in str(raised.value)
    episodes = pack([[1, 2]], [[Span([5, 6], [0.0, 0.0])]], [True], 0, environment=said)
    assert len(experience.with_scores(episodes, scored, 0, lambda t: t * 2, uneven_forwards=True)) == 2  # ddp: rows may differ


# --------------------------------------------------------------------------- the trainer's update with an agent that rewrites its history

REWRITING = '''
import itertools

from openai import OpenAI

TOOLS = {tools}
REWARDS = itertools.count()


def solve(row, base_url):
    client = OpenAI(base_url=base_url, api_key="anything")
    client.chat.completions.create(model="policy", messages=row["messages"], tools=TOOLS)
    # the history rewritten as text: the next call starts a segment of its own
    messages = row["messages"] + [{{"role": "assistant", "content": "I asked add(17, 25) and it said 42."}},
                                  {{"role": "user", "content": "So what is it?"}}]
    client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=12)
    return float(next(REWARDS) % 2)
'''


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_an_agent_that_rewrites_its_history_trains_both_segments_with_the_episodes_advantage(tmp_path, monkeypatch, estimator):
    from test_agent import FAMILY, schemas, steered_model, trainer_for, write_agent

    tok = FAMILY.tokenizer()
    tools = schemas(tmp_path)
    model, prompt, call, observation, answer = steered_model(tok, tools)
    ppo = {"advantage_estimator": estimator, "loss_aggregation": "seq_mean_token_mean", "kl_coef": 0.0}
    if estimator == "gae":
        ppo.update(num_samples_per_prompt=1, whiten_advantages=False, lam=1.0)
    trainer = trainer_for(tmp_path, "agent", model, tok, agent=write_agent(tmp_path, tools, REWRITING), ppo=ppo)
    seen, losses = {}, []
    optimise, ppo_loss = trainer.optimise, algo.ppo_loss

    def recorded_loss(settings, normalisers, mask, *args, **kwargs):
        losses.append((normalisers.policy.item(), algo.token_weights(mask, settings.aggregation, kwargs.get("row_share")).sum().item()))
        return ppo_loss(settings, normalisers, mask, *args, **kwargs)

    monkeypatch.setattr(trainer, "optimise", lambda episodes: optimise(seen.setdefault("episodes", episodes)))
    monkeypatch.setattr(algo, "ppo_loss", recorded_loss)
    record = trainer.step()
    episodes = seen["episodes"]
    assert len(episodes) == 4 and episodes.episode_index.tolist() == [0, 1, 0, 1]
    assert record["agent/segments"] == 2.0 and record["agent/trained_share"] == 1.0
    stop = tok.convert_tokens_to_ids(FAMILY.stop)
    for row in (2, 3):  # the earlier segments: the first call, every sampled token trained, no reward on them
        assert episodes.query_ids[row][episodes.query_mask[row]].tolist() == prompt
        assert episodes.response_ids[row][episodes.trained_mask[row]].tolist() == call
        assert episodes.scores[row].item() == 0.0 and episodes.turn_rewards[row].sum().item() == 0.0
    for row in (0, 1):  # the last segments: the second call, the reward at its last model token
        trained = episodes.response_ids[row][episodes.trained_mask[row]].tolist()
        assert 0 < len(trained) <= 12 and stop not in trained[:-1]
    assert sorted(episodes.scores[:2].tolist()) == [0.0, 1.0]
    assert episodes.rewards[2:].abs().sum().item() == 0.0  # kl_coef 0: the rewards are the scores, on the last segments
    assert [episodes.rewards[row, episodes.score_index[row]].item() for row in (0, 1)] == episodes.scores[:2].tolist()
    adv = episodes.advantages
    if estimator == "grpo":  # the group of the two episodes: +-1/std on every token of each episode's two rows
        want = algo.grpo_advantages(episodes.scores[:2], torch.ones(2, dtype=torch.bool), 2, True)
        for row, e in enumerate([0, 1, 0, 1]):
            assert adv[row][episodes.trained_mask[row]].unique().tolist() == [want[e].item()] and want[e] != 0
    else:  # gamma = lam = 1 by default: every token's advantage is the episode's reward less its value, the earlier rows' too
        for row, e in enumerate([0, 1, 0, 1]):
            mask = episodes.trained_mask[row]
            torch.testing.assert_close(adv[row][mask], episodes.scores[e] - episodes.values[row][mask], rtol=0,
                                       atol=4 * torch.finfo(torch.float32).eps * (1 + episodes.values.abs().max().item()))
    # one micro-batch of the two episodes' four rows: the sequences are the 2 episodes, each one's weights summing to 1
    assert losses and all(d == pytest.approx(2.0, abs=1e-5) and w == pytest.approx(2.0, abs=1e-5) for d, w in losses)


SUBAGENT = '''
import asyncio

from openai import AsyncOpenAI


async def solve(row, base_url):
    client = AsyncOpenAI(base_url=base_url, api_key="anything")
    plan = await client.chat.completions.create(model="policy", messages=[{{"role": "user", "content": "Plan: " + row["prompt"]}}])
    answer = await client.chat.completions.create(model="policy", messages=[{{"role": "user", "content": row["prompt"]}}])
    text = (plan.choices[0].message.content or "") + (answer.choices[0].message.content or "")
    return float(len(text) % 2)
'''


def test_ppokit_ppo_trains_an_agent_whose_calls_make_two_segments(tmp_path):
    from test_agent import ppokit_ppo_updates

    updates = ppokit_ppo_updates(tmp_path, SUBAGENT.format(), {"max_turns": 2},
                                 {"per_device_train_batch_size": 2, "num_mini_batches": 2, "advantage_estimator": "rloo",
                                  "loss_aggregation": "seq_mean_token_mean"})
    assert len(updates) == 2
    assert all(r["agent/segments"] == 2.0 and r["agent/trained_share"] == 1.0 and r["agent/retokenized_share"] == 1.0 for r in updates)


TWO_SEGMENTS = '''
from openai import OpenAI


def solve(row, base_url):
    client = OpenAI(base_url=base_url, api_key="anything", max_retries=0)
    first = client.chat.completions.create(model="policy", messages=[{{"role": "user", "content": "Plan: " + row["prompt"]}}]).choices[0].message
    second = client.chat.completions.create(model="policy", messages=[{{"role": "user", "content": row["prompt"]}}]).choices[0].message
    return float(len((first.content or "") + (second.content or "")) % 3 == 0)
'''


def test_a_run_of_segment_rows_resumed_after_a_crash_is_the_run_it_would_have_been(tmp_path):
    from test_agent import resumed_and_straight

    got = resumed_and_straight(tmp_path, TWO_SEGMENTS, num_sample_generations=0, loss_aggregation="seq_mean_token_mean")
    assert all(r["agent/segments"] == 2.0 and r["agent/trained_share"] == 1.0 for r in got)


UNEVEN = '''
from openai import AsyncOpenAI


async def solve(row, base_url):
    client = AsyncOpenAI(base_url=base_url, api_key="anything")
    text = ""
    if row["prompt"][-1] in "02":  # a sub-agent's plan first: two segments for half the rows
        plan = await client.chat.completions.create(model="policy", messages=[{{"role": "user", "content": "Plan: " + row["prompt"]}}])
        text += plan.choices[0].message.content or ""
    answer = await client.chat.completions.create(model="policy", messages=[{{"role": "user", "content": row["prompt"]}}])
    return float(len(text + (answer.choices[0].message.content or "")) % 2)
'''


def test_two_ddp_processes_train_different_numbers_of_segment_rows_and_fsdp_refuses_them(tmp_path):
    """One prompt (its 2 runs of the agent) per process and update: a process whose prompt's agent makes two segments
    holds 4 rows, the other 2; ddp trains them (one no-gradient forward per row on each process), fsdp stops in one line."""
    import yaml
    from test_agent import FAMILY, saved_policy
    from test_multiprocess import TORCHRUN, _env, _free_port

    if TORCHRUN is None:
        pytest.skip("torchrun is not on PATH")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"Say something {i}"}) + "\n" for i in range(4)))
    (tmp_path / "agent.py").write_text(UNEVEN.format())
    model = saved_policy(tmp_path)
    results = {}
    for strategy in ("ddp", "fsdp"):
        config = {"model": str(model), "output_dir": str(tmp_path / strategy), "agent": "agent.py:solve", "data": {"train": "data.jsonl"},
                  "rollout": {"max_turns": 2}, "parallel": {"strategy": strategy},
                  "ppo": {"total_episodes": 8, "per_device_train_batch_size": 2, "num_mini_batches": 1, "response_length": 8,
                          "num_sample_generations": 0, "advantage_estimator": "rloo", "num_samples_per_prompt": 2, "stop_token": FAMILY.stop,
                          "local_rollout_forward_batch_size": 1}}
        (tmp_path / f"{strategy}.yaml").write_text(yaml.safe_dump(config))
        command = [TORCHRUN, "--nproc_per_node", "2", "--master_port", str(_free_port()), "-m", "ppokit", "ppo", f"{strategy}.yaml"]
        results[strategy] = subprocess.run(command, capture_output=True, text=True, timeout=900, env=_env(), cwd=tmp_path)
    assert results["ddp"].returncode == 0, results["ddp"].stderr[-3000:]
    updates = [json.loads(line) for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert len(updates) == 2 and any(r["agent/segments"] == 1.5 for r in updates)  # 2 segments on one process, 1 on the other
    assert results["fsdp"].returncode != 0
    assert "ppokit: error: agent: " in results["fsdp"].stderr and "processes under parallel.strategy fsdp do not do yet" in results["fsdp"].stderr
