"""The PPO mathematics in one name space (`algo.gae`, `algo.ppo_loss`, ...), for the callers that read it so; each
function lives in the module of what it computes, pure functions over tensors that import only torch:

    logprobs.py       token logprobs and entropies from logits or hidden states (chunked through the LM head)
    masks.py          where responses stop, truncated rows, the last trained token, row orders
    statistics.py     masked means, variances, whitening, explained variance, pass@k
    token_rewards.py  the per-token KL, the score placed, turn rewards, distillation rewards; the KL controllers
    advantages.py     GAE and the critic-free estimators (GRPO, RLOO, REINFORCE++, ReMax)
    losses.py         the clipped policy and value losses, importance weights, aggregation, `ppo_loss`, Bradley-Terry
"""

from ppokit.training.logprobs import (  # noqa: F401
    logprobs_from_logits, logprobs_and_entropy, _HeadLogprobs, _row_blocks, head_logprobs_and_entropy, chunked_head_logprobs,
)
from ppokit.training.masks import (  # noqa: F401
    first_true_index, is_stop, truncate_after_stop, mask_truncated, last_token_index, mask_first_order, restore_order,
)
from ppokit.training.statistics import (  # noqa: F401
    AllReduce, masked_mean, masked_var, masked_whiten, _summed, _masked_mean_and_var, whiten_over_batch, explained_variance, pass_at_k,
)
from ppokit.training.token_rewards import (  # noqa: F401
    KL_ESTIMATORS, LOG_RATIO_CLAMP, clamp_log_ratio, kl_per_token, shape_rewards, place_turn_rewards, distillation_rewards, AdaptiveKLController,
    FixedKLController, kl_controller,
)
from ppokit.training.advantages import (  # noqa: F401
    gae, _gae_prefix, sequence_rewards, _groups, grpo_advantages, grpo_advantages_batch_std, rloo_advantages, discounted_returns,
    _discounted_returns_prefix, reinforce_pp_advantages, remax_advantages,
)
from ppokit.training.losses import (  # noqa: F401
    LOSS_AGGREGATIONS, PolicyLossStats, truncated_is_weights, truncated_is_sequence_weights, sequence_log_ratio, policy_loss_per_token,
    decoupled_policy_loss, _policy_stats, clipped_policy_loss, value_loss_per_token, clipped_value_loss, token_weights, LossNormalisers,
    loss_normalisers, aggregate, LossSettings, LossTerms, value_loss, ppo_loss, bradley_terry_loss,
)
