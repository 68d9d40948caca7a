"""Reward sources behind one small Protocol, and the scorer that turns them into one score per episode.

    sources.py   ScoringBatch, the RewardSource Protocol, Python functions as sources
    builtins.py  sentiment, exact_match, math_equivalence, regex, format, length, contains, reasoning_gym
    model.py     a sequence-classification reward model, with its own tokenizer if need be
    remote.py    a scorer behind HTTP, and `ppokit serve-rm` to serve any source
    scorer.py    weights, running normalisation, shaping, failure handling; check_sources (no weights), build_scorer(config)
"""

from ppokit.rewards.builtins import BUILTINS, Contains, ExactMatch, Format, Length, MathEquivalence, ReasoningGym, Regex, sentiment
from ppokit.rewards.model import RewardModelReward, load_reward_model, reward_model_source
from ppokit.rewards.remote import RemoteReward, make_server, serve
from ppokit.rewards.scorer import (
    CheckedSources,
    RewardScorer,
    RunningMoments,
    ScoreResult,
    as_source,
    build_scorer,
    check_sources,
    function_source,
    source_from_argument,
    source_label,
)
from ppokit.rewards.sources import (
    FunctionReward,
    RewardError,
    RewardSource,
    ScoringBatch,
    check_scores,
    completion_token_ids,
    load_function,
)

# `ppokit.rewards:reasoning_gym` in a config: the built-in with its defaults (`reasoning_gym` names it too)
reasoning_gym = ReasoningGym()

__all__ = [
    "BUILTINS", "Contains", "ExactMatch", "Format", "Length", "MathEquivalence", "ReasoningGym", "Regex", "sentiment",
    "reasoning_gym",
    "RewardModelReward", "load_reward_model", "reward_model_source",
    "RemoteReward", "make_server", "serve",
    "CheckedSources", "RewardScorer", "RunningMoments", "ScoreResult", "as_source", "build_scorer", "check_sources", "function_source",
    "source_from_argument", "source_label",
    "FunctionReward", "RewardError", "RewardSource", "ScoringBatch", "check_scores", "completion_token_ids", "load_function",
]
