"""RL algorithms as pure functions: advantage estimators, the unified objective, presets.

>>> from rlaxkit.algorithms import algorithm, PRESETS
>>> algorithm("dapo").loss.clip_eps_high
0.28
>>> "decoupled_ppo" in PRESETS
True
"""

from rlaxkit.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    gae_advantages,
    group_statistics,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
    terminal_rewards,
)
from rlaxkit.algorithms.config import AdvantageConfig, AlgorithmConfig, LossConfig
from rlaxkit.algorithms.covariance import token_covariance
from rlaxkit.algorithms.distill import (
    DistillConfig,
    distillation_advantages,
    distillation_rewards,
    full_distillation_loss,
    reverse_kl,
)
from rlaxkit.algorithms.objective import (
    KL_ESTIMATORS,
    SURROGATES,
    LossInputs,
    SurrogateContext,
    aggregation_weights,
    clipped_value_loss,
    combine_metrics,
    importance_ratio,
    rl_loss,
    trust_region_centre,
)
from rlaxkit.algorithms.off_policy import (
    LOG_RATIO_BOUND,
    REJECTION_MASKS,
    behaviour_weights,
    loglinear_proximal_logprobs,
    rejection_mask,
)
from rlaxkit.algorithms.presets import PRESETS, algorithm
from rlaxkit.algorithms.registry import Registry
from rlaxkit.algorithms.value_model import ValueModel

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOG_RATIO_BOUND",
    "PRESETS",
    "REJECTION_MASKS",
    "SURROGATES",
    "AdvantageConfig",
    "AdvantageInputs",
    "AlgorithmConfig",
    "DistillConfig",
    "LossConfig",
    "LossInputs",
    "Registry",
    "SurrogateContext",
    "ValueModel",
    "aggregation_weights",
    "algorithm",
    "behaviour_weights",
    "clipped_value_loss",
    "combine_metrics",
    "compute_advantages",
    "distillation_advantages",
    "distillation_rewards",
    "full_distillation_loss",
    "gae_advantages",
    "group_statistics",
    "grpo_advantages",
    "importance_ratio",
    "loglinear_proximal_logprobs",
    "masked_whiten",
    "reinforce_pp_advantages",
    "rejection_mask",
    "reverse_kl",
    "rl_loss",
    "rloo_advantages",
    "terminal_rewards",
    "token_covariance",
    "trust_region_centre",
]
