"""Frozen, validated configs of an RL algorithm: its advantage and its loss.

Every choice is a ``Literal`` checked in ``__post_init__`` against the values it allows,
so a typo fails when the config is built, naming the field and the allowed values — never
inside a jitted step. A choice that names a registered variant (``Estimator``,
``Surrogate``, ``KLEstimator``, ``Rejection``) allows exactly the names its registry holds
(``tests/test_algorithms.py`` checks it), so this module sits below the modules that
implement the variants and name these configs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from rlaxkit.rules.validation import is_int, is_number

Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"]
Aggregation = Literal["sequence_mean", "token_mean", "fixed_length", "token_sum"]
RatioLevel = Literal["token", "sequence"]
Surrogate = Literal["ppo_clip", "dual_clip", "cispo", "clip_cov", "kl_cov", "none"]
Proximal = Literal["behaviour", "recompute", "loglinear", "batch"]
BehaviourWeight = Literal["none", "full", "truncate", "mask"]
KLEstimator = Literal["k1", "k2", "k3", "k1+", "k3+"]
Rejection = Literal["none", "token", "sequence", "geometric"]
GroupOfOne = Literal["zero", "reward"]
Convention = Literal["rlaxkit", "verl"]


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: must be one of {allowed}, got {value!r}")


def _number(
    name: str, value: Any, *, low: float, high: float = math.inf, open_low: bool = False
) -> None:
    ok = is_number(value) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low) and value <= high
    if not ok:
        bound = f"> {low}" if open_low else f">= {low}"
        upper = "" if high == math.inf else f" and <= {high}"
        raise ValueError(f"{name}: must be a finite number {bound}{upper}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """How rewards become advantages (see ``rlaxkit.algorithms.advantages``).

    Attributes:
        estimator: ``grpo`` (group mean/std), ``dr_grpo`` (group mean only), ``rloo``
            (leave-one-out mean), ``reinforce_pp`` (batch-whitened return) or ``gae``
            (critic + GAE, needs a value model).
        scale_by_std: ``grpo`` divides by the group std; ``False`` keeps only centring.
        eps: added to every std before dividing.
        gamma: discount per policy token of ``gae`` and of ``reinforce_pp``'s returns.
        lam: GAE λ.
        kl_in_reward_coef: β of a per-token ``-β (log π_old - log π_ref)`` reward
            (``reinforce_pp`` and ``gae``); needs a reference model when > 0.
        whiten: whiten the final advantages over the batch's completion tokens.
        group_of_one: advantage of a prompt sampled once under ``grpo``, ``dr_grpo`` and
            ``rloo``: ``zero`` (no baseline, no signal) or ``reward`` (baseline 0 and
            scale 1, so the advantage is the reward: verl's choice).
        convention: ``rlaxkit`` whitens with the population std as ``(x - mean) /
            (std + eps)`` and gives 0 where a group's or batch's std is at most ``eps``
            (all rewards equal); ``verl`` whitens with the Bessel-corrected variance as
            ``(x - mean) / sqrt(var + 1e-8)`` and divides group rewards by ``std + eps``
            whatever the spread (see ``docs/algorithms.md``).
    """

    estimator: Estimator = "grpo"
    scale_by_std: bool = True
    eps: float = 1e-6
    gamma: float = 1.0
    lam: float = 0.95
    kl_in_reward_coef: float = 0.0
    whiten: bool = False
    group_of_one: GroupOfOne = "zero"
    convention: Convention = "rlaxkit"

    def __post_init__(self) -> None:
        _choice("estimator", self.estimator, tuple(sorted(get_args(Estimator))))
        _choice("group_of_one", self.group_of_one, get_args(GroupOfOne))
        _choice("convention", self.convention, get_args(Convention))
        _number("eps", self.eps, low=0.0, open_low=True)
        _number("gamma", self.gamma, low=0.0, high=1.0)
        _number("lam", self.lam, low=0.0, high=1.0)
        _number("kl_in_reward_coef", self.kl_in_reward_coef, low=0.0)
        if self.kl_in_reward_coef and self.estimator not in ("reinforce_pp", "gae"):
            raise ValueError(
                "kl_in_reward_coef: only the estimators ('reinforce_pp', 'gae') fold a KL "
                f"penalty into the reward; got estimator {self.estimator!r}"
            )


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The slots of the unified objective (see ``rlaxkit.algorithms.objective``).

    Attributes:
        aggregation: per-token weight ``Agg``: ``sequence_mean`` ``1/(G|o_i|)``,
            ``token_mean`` ``1/Σ|o_i|``, ``fixed_length`` ``1/(G·L)`` or ``token_sum`` 1.
        fixed_length: ``L`` of ``fixed_length`` aggregation (the sampler's token budget,
            so the loss scale does not depend on the batch's padded length).
        ratio_level: ``token`` ratio ``π_θ/π_old`` or GSPO's ``sequence`` (geometric mean
            over the sequence).
        surrogate: ``ppo_clip`` (two-sided; ``clip_eps_high > clip_eps_low`` is DAPO's
            clip-higher), ``dual_clip``, ``cispo``, ``clip_cov``, ``kl_cov``
            (entropy-preserving, ``rlaxkit.algorithms.covariance``) or ``none``
            (plain ratio · A).
        clip_eps_low: ratio floor ``1 - ε_low``.
        clip_eps_high: ratio ceiling ``1 + ε_high``.
        dual_clip_c: ``c > 1`` of dual clip: negative-advantage loss is at most ``-c·A``.
        proximal: trust-region centre ``π_old``: the ``behaviour`` log-probs (standard),
            ``recompute``\\ d by the trainer before its updates, ``loglinear``
            interpolation by version (AReaL), or the ``batch``'s ``proximal_logprobs``.
        behaviour_weight: stop-gradient importance weight ``w = π_old / π_behaviour`` on
            each token: ``none``, ``full`` (AReaL decoupled PPO), ``truncate``
            (``min(w, C)``, TIS) or ``mask`` (drop tokens with ``w > C``, MIS).
        behaviour_weight_cap: ``C``.
        behaviour_weight_level: ``token`` weights or one ``sequence`` weight (the
            product of the token weights).
        kl_estimator: estimator of ``KL(π_θ || π_ref)`` per token: ``k1``, ``k2``, ``k3``,
            or ``k1+``/``k3+`` (their value, ``k2``'s gradient).
        kl_coef: weight of the KL term (needs a reference model when > 0).
        entropy_coef: weight of the entropy bonus.
        value_coef: weight of the critic loss (needs a value model when > 0).
        value_clip_eps: PPO value clipping around the values before the update.
        cov_fraction: share ``r`` of tokens ``clip_cov``/``kl_cov`` treat.
        clip_cov_low, clip_cov_high: ``clip_cov``'s covariance band ``(ω_low, ω_high)``.
        kl_cov_coef: ``kl_cov``'s β on ``|log r|``.
        rejection: rollout rejection mask on ``π_old/π_behaviour``: ``none``, ``token``
            (IcePop), ``sequence`` (the product) or ``geometric`` (the per-token geometric
            mean); rejected tokens leave the loss and its normaliser.
        rejection_low, rejection_high: the kept band ``[low, high]`` of that ratio.
    """

    aggregation: Aggregation = "token_mean"
    fixed_length: int | None = None
    ratio_level: RatioLevel = "token"
    surrogate: Surrogate = "ppo_clip"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float = 3.0
    proximal: Proximal = "behaviour"
    behaviour_weight: BehaviourWeight = "none"
    behaviour_weight_cap: float = 2.0
    behaviour_weight_level: RatioLevel = "token"
    kl_estimator: KLEstimator = "k3"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    value_coef: float = 0.0
    value_clip_eps: float = 0.2
    cov_fraction: float = 2e-4
    clip_cov_low: float = 1.0
    clip_cov_high: float = 5.0
    kl_cov_coef: float = 1.0
    rejection: Rejection = "none"
    rejection_low: float = 0.5
    rejection_high: float = 2.0

    def __post_init__(self) -> None:
        _choice("aggregation", self.aggregation, get_args(Aggregation))
        _choice("ratio_level", self.ratio_level, get_args(RatioLevel))
        _choice("surrogate", self.surrogate, tuple(sorted(get_args(Surrogate))))
        _choice("proximal", self.proximal, get_args(Proximal))
        _choice("behaviour_weight", self.behaviour_weight, get_args(BehaviourWeight))
        _choice("behaviour_weight_level", self.behaviour_weight_level, get_args(RatioLevel))
        _choice("kl_estimator", self.kl_estimator, tuple(sorted(get_args(KLEstimator))))
        _number("clip_eps_low", self.clip_eps_low, low=0.0, high=1.0, open_low=True)
        _number("clip_eps_high", self.clip_eps_high, low=0.0, open_low=True)
        _number("dual_clip_c", self.dual_clip_c, low=1.0, open_low=True)
        _number("behaviour_weight_cap", self.behaviour_weight_cap, low=1.0)
        for name in ("kl_coef", "entropy_coef", "value_coef"):
            _number(name, getattr(self, name), low=0.0)
        _number("value_clip_eps", self.value_clip_eps, low=0.0, open_low=True)
        _choice("rejection", self.rejection, tuple(sorted(get_args(Rejection))))
        _number("cov_fraction", self.cov_fraction, low=0.0, high=1.0, open_low=True)
        _number("clip_cov_low", self.clip_cov_low, low=-math.inf)
        _number("clip_cov_high", self.clip_cov_high, low=self.clip_cov_low, open_low=True)
        _number("kl_cov_coef", self.kl_cov_coef, low=0.0)
        _number("rejection_low", self.rejection_low, low=0.0, high=1.0, open_low=True)
        _number("rejection_high", self.rejection_high, low=1.0)
        if self.rejection != "none" and self.proximal not in ("recompute", "batch"):
            raise ValueError(
                f"rejection: {self.rejection!r} compares the trainer's log-probs before the "
                "update with the sampler's, so it needs proximal in ('recompute', 'batch'); "
                f"got proximal {self.proximal!r}"
            )
        if self.aggregation == "fixed_length":
            if not is_int(self.fixed_length) or self.fixed_length <= 0:
                raise ValueError(
                    "fixed_length: aggregation 'fixed_length' needs a positive integer "
                    f"token budget, got {self.fixed_length!r}"
                )
        elif self.fixed_length is not None:
            raise ValueError(
                f"fixed_length: only used by aggregation 'fixed_length', got aggregation "
                f"{self.aggregation!r}; leave fixed_length as None"
            )
        if self.behaviour_weight != "none" and self.proximal == "behaviour":
            raise ValueError(
                "behaviour_weight: with proximal 'behaviour' the weight π_old/π_behaviour is "
                "1; choose proximal in ('recompute', 'loglinear', 'batch') or "
                "behaviour_weight 'none'"
            )

    @property
    def needs_proximal_recompute(self) -> bool:
        """The trainer runs a forward pass under the pre-update weights."""
        return self.proximal == "recompute"


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """A named RL algorithm: advantage estimator plus loss.

    Attributes:
        name: preset name (``rlaxkit.algorithms.PRESETS``) or a label for a custom mix.
        advantage: how rewards become advantages.
        loss: the objective's slots.
    """

    name: str = "custom"
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: must be a non-empty string, got {self.name!r}")
        if self.advantage.estimator == "gae" and self.loss.value_coef <= 0:
            raise ValueError(
                "loss.value_coef: estimator 'gae' trains a critic, so value_coef must be > 0"
            )
        if self.loss.value_coef > 0 and self.advantage.estimator != "gae":
            raise ValueError(
                "loss.value_coef: only estimator 'gae' uses a critic; got estimator "
                f"{self.advantage.estimator!r} with value_coef {self.loss.value_coef}"
            )

    @property
    def needs_reference(self) -> bool:
        """A reference model's log-probs are needed (KL in the loss or in the reward)."""
        return self.loss.kl_coef > 0 or self.advantage.kl_in_reward_coef > 0

    @property
    def needs_value_model(self) -> bool:
        """A critic is trained alongside the policy."""
        return self.advantage.estimator == "gae"

    def replace(self, **changes: Any) -> AlgorithmConfig:
        """A validated copy; ``advantage`` and ``loss`` may be given as dicts of changes."""
        for part in ("advantage", "loss"):
            if isinstance(changes.get(part), dict):
                changes[part] = dataclasses.replace(getattr(self, part), **changes[part])
        return dataclasses.replace(self, **changes)
