"""Named algorithms: each a frozen ``AlgorithmConfig`` built from the papers' settings.

``algorithm("dapo")`` returns the preset; ``algorithm("dapo", loss={"kl_coef": 0.01})``
returns it with changes, validated again. Defaults follow the cited papers where they
state one; where a paper leaves a knob to tuning, the docstring says so.

Which groups a preset trains on is the run's ``BatchPolicy``, not the preset's: by
default a group whose rewards are all equal is dropped as ``filtered`` (DAPO's dynamic
sampling; under every group-relative preset its advantages are zero).
``batching.equal_rewards=keep`` trains every group, as GRPO, Dr.GRPO, RLOO,
REINFORCE++, GSPO and CISPO were published and as peer libraries default; compare
against another implementation with it.
"""

from __future__ import annotations

from collections.abc import Callable

from rlaxkit.algorithms.config import AdvantageConfig, AlgorithmConfig, LossConfig
from rlaxkit.algorithms.registry import Registry

PRESETS: Registry[Callable[[], AlgorithmConfig]] = Registry("algorithm preset")


def algorithm(name: str, **changes: object) -> AlgorithmConfig:
    """The preset ``name`` with ``changes`` (``advantage``/``loss`` may be dicts)."""
    config = PRESETS.get(name)()
    return config.replace(**changes) if changes else config


@PRESETS.register("ppo")
def ppo() -> AlgorithmConfig:
    """PPO with a critic (Schulman et al. 2017, arXiv 1707.06347; for language models
    Ouyang et al. 2022, arXiv 2203.02155).

    GAE (γ = 1, λ = 0.95) on the terminal reward, advantages whitened over the batch,
    two-sided clip ε = 0.2, token-mean aggregation, clipped value loss with weight 0.5.
    """
    return AlgorithmConfig(
        name="ppo",
        advantage=AdvantageConfig(estimator="gae", gamma=1.0, lam=0.95, whiten=True),
        loss=LossConfig(aggregation="token_mean", surrogate="ppo_clip", value_coef=0.5),
    )


@PRESETS.register("grpo")
def grpo() -> AlgorithmConfig:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300).

    ``A_i = (R_i - mean_g R) / std_g R``; per-sequence mean of token terms; clip ε = 0.2;
    k3 KL to the reference with β = 0.04 (needs a reference model). As published it
    trains every group: ``batching.equal_rewards=keep`` (the run drops groups of equal
    rewards by default).
    """
    return AlgorithmConfig(
        name="grpo",
        advantage=AdvantageConfig(estimator="grpo"),
        loss=LossConfig(aggregation="sequence_mean", kl_estimator="k3", kl_coef=0.04),
    )


@PRESETS.register("dr_grpo")
def dr_grpo() -> AlgorithmConfig:
    """Dr.GRPO (Liu et al. 2025, arXiv 2503.20783): GRPO without its two biases.

    ``A_i = R_i - mean_g R`` (no std) and the constant normaliser ``1/(G·L)`` instead of
    ``1/|o_i|``; no KL. ``L`` should be the sampler's generation budget; the preset
    uses 1024 — set ``loss={"fixed_length": max_new_tokens}``.
    """
    return AlgorithmConfig(
        name="dr_grpo",
        advantage=AdvantageConfig(estimator="dr_grpo"),
        loss=LossConfig(aggregation="fixed_length", fixed_length=1024),
    )


@PRESETS.register("dapo")
def dapo() -> AlgorithmConfig:
    """DAPO (Yu et al. 2025, arXiv 2503.14476).

    Group-normalised advantages, clip-higher (ε_low = 0.2, ε_high = 0.28), token-level
    mean over the batch, no KL. Dynamic sampling is the run's default
    ``batching.equal_rewards=drop`` (the buffer's business, not the loss's; overlong
    shaping is the reward's).
    """
    return AlgorithmConfig(
        name="dapo",
        advantage=AdvantageConfig(estimator="grpo"),
        loss=LossConfig(aggregation="token_mean", clip_eps_low=0.2, clip_eps_high=0.28),
    )


@PRESETS.register("rloo")
def rloo() -> AlgorithmConfig:
    """RLOO (Ahmadian et al. 2024, arXiv 2402.14740): REINFORCE with a leave-one-out
    baseline, ``A_i = R_i - mean_{j≠i} R_j``; plain (unclipped) ratio, per-sequence sum
    averaged over sequences (``sequence_mean``); no KL."""
    return AlgorithmConfig(
        name="rloo",
        advantage=AdvantageConfig(estimator="rloo"),
        loss=LossConfig(aggregation="sequence_mean", surrogate="none"),
    )


@PRESETS.register("reinforce_pp")
def reinforce_pp() -> AlgorithmConfig:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): returns whitened over the whole batch,
    PPO clip ε = 0.2, token-level mean. The paper's per-token KL reward is
    ``advantage={"kl_in_reward_coef": β}`` (needs a reference); off by default."""
    return AlgorithmConfig(
        name="reinforce_pp",
        advantage=AdvantageConfig(estimator="reinforce_pp"),
        loss=LossConfig(aggregation="token_mean"),
    )


@PRESETS.register("gspo")
def gspo() -> AlgorithmConfig:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): sequence-level ratio
    ``s_i = (π_θ(o_i)/π_old(o_i))^{1/|o_i|}`` clipped to ``[1 - 3e-4, 1 + 4e-4]``, the
    paper's ranges; group-normalised advantages; per-sequence mean; no KL."""
    return AlgorithmConfig(
        name="gspo",
        advantage=AdvantageConfig(estimator="grpo"),
        loss=LossConfig(
            aggregation="sequence_mean",
            ratio_level="sequence",
            clip_eps_low=3e-4,
            clip_eps_high=4e-4,
        ),
    )


@PRESETS.register("cispo")
def cispo() -> AlgorithmConfig:
    """CISPO (MiniMax-M1, arXiv 2506.13585): ``sg(clip(r, 1-ε_low, 1+ε_high)) A log π``,
    token-level mean, group-normalised advantages, no KL. The paper bounds the weight
    from above only (ε_low = 1 here, i.e. no floor); ε_high is tuned — 0.28 by default."""
    return AlgorithmConfig(
        name="cispo",
        advantage=AdvantageConfig(estimator="grpo"),
        loss=LossConfig(
            aggregation="token_mean", surrogate="cispo", clip_eps_low=1.0, clip_eps_high=0.28
        ),
    )


@PRESETS.register("decoupled_ppo")
def decoupled_ppo() -> AlgorithmConfig:
    """AReaL decoupled PPO (Fu et al. 2025, arXiv 2505.24298).

    ``sg(π_prox/π_behaviour) · min(r A, clip(r) A)`` with ``r = π_θ/π_prox``; the
    proximal log-probs are recomputed by the trainer before its updates (switch to
    ``loss={"proximal": "loglinear"}`` to skip that forward pass). Group-normalised
    advantages, token-level mean, clip ε = 0.2, full (uncapped) behaviour weight as in
    the paper; ``behaviour_weight="mask"`` adds a cap. AReaL filters groups of equal
    rewards as the run does by default (``batching.equal_rewards=drop``).
    """
    return AlgorithmConfig(
        name="decoupled_ppo",
        advantage=AdvantageConfig(estimator="grpo"),
        loss=LossConfig(aggregation="token_mean", proximal="recompute", behaviour_weight="full"),
    )
