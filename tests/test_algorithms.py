"""The public surface of rlaxkit.algorithms: registries, presets and config validation."""

import dataclasses
import typing

import pytest

import rlaxkit.algorithms as algorithms
from rlaxkit.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    PRESETS,
    REJECTION_MASKS,
    SURROGATES,
    AdvantageConfig,
    AlgorithmConfig,
    LossConfig,
    Registry,
    algorithm,
)
from rlaxkit.algorithms.config import Estimator, KLEstimator, Rejection, Surrogate

EXPECTED_PRESETS = {
    "ppo",
    "grpo",
    "dr_grpo",
    "dapo",
    "rloo",
    "reinforce_pp",
    "gspo",
    "cispo",
    "decoupled_ppo",
}


def test_package_reexports_its_public_names():
    for name in algorithms.__all__:
        assert hasattr(algorithms, name), name


def test_registries_hold_the_documented_variants():
    assert set(PRESETS.names()) == EXPECTED_PRESETS
    assert set(ADVANTAGE_ESTIMATORS.names()) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"}
    assert set(SURROGATES.names()) == {
        "ppo_clip",
        "dual_clip",
        "cispo",
        "clip_cov",
        "kl_cov",
        "none",
    }
    assert set(KL_ESTIMATORS.names()) == {"k1", "k2", "k3", "k1+", "k3+"}
    assert set(REJECTION_MASKS.names()) == {"none", "token", "sequence", "geometric"}


@pytest.mark.parametrize(
    "registry, choice",
    [
        (ADVANTAGE_ESTIMATORS, Estimator),
        (SURROGATES, Surrogate),
        (KL_ESTIMATORS, KLEstimator),
        (REJECTION_MASKS, Rejection),
    ],
)
def test_a_config_allows_exactly_the_names_its_registry_holds(registry, choice):
    """The configs check names against their ``Literal``s, the registries implement them."""
    assert registry.names() == tuple(sorted(typing.get_args(choice)))


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_presets_are_frozen_named_and_documented(name):
    config = algorithm(name)
    assert isinstance(config, AlgorithmConfig) and config.name == name
    assert "arXiv" in PRESETS.get(name).__doc__
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.name = "other"  # type: ignore[misc]


def test_presets_encode_their_papers():
    assert algorithm("dapo").loss.clip_eps_high == 0.28
    assert algorithm("dr_grpo").advantage.estimator == "dr_grpo"
    assert algorithm("dr_grpo").loss.aggregation == "fixed_length"
    assert algorithm("gspo").loss.ratio_level == "sequence"
    assert algorithm("cispo").loss.surrogate == "cispo"
    assert algorithm("grpo").needs_reference and not algorithm("dapo").needs_reference
    assert algorithm("ppo").needs_value_model
    decoupled = algorithm("decoupled_ppo").loss
    assert (decoupled.proximal, decoupled.behaviour_weight) == ("recompute", "full")


def test_algorithm_applies_and_validates_changes():
    config = algorithm("grpo", loss={"kl_coef": 0.0}, advantage={"scale_by_std": False})
    assert config.loss.kl_coef == 0.0 and not config.advantage.scale_by_std
    assert config.loss.aggregation == "sequence_mean"  # the rest of the preset is kept
    with pytest.raises(ValueError, match="kl_coef"):
        algorithm("grpo", loss={"kl_coef": -1.0})
    with pytest.raises(ValueError, match="unknown algorithm preset 'grpo2'.*registered"):
        algorithm("grpo2")


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        (dict(aggregation="mean"), "aggregation", "token_mean"),
        (dict(surrogate="ppo"), "surrogate", "ppo_clip"),
        (dict(ratio_level="group"), "ratio_level", "sequence"),
        (dict(proximal="latest"), "proximal", "loglinear"),
        (dict(behaviour_weight="clip"), "behaviour_weight", "truncate"),
        (dict(kl_estimator="k4"), "kl_estimator", "k3"),
        (dict(clip_eps_low=1.5), "clip_eps_low", "<= 1"),
        (dict(clip_eps_high=0.0), "clip_eps_high", "> 0"),
        (dict(dual_clip_c=1.0), "dual_clip_c", "> 1"),
        (dict(behaviour_weight_cap=0.5), "behaviour_weight_cap", ">= 1"),
        (dict(entropy_coef=float("nan")), "entropy_coef", "finite"),
        (dict(aggregation="fixed_length"), "fixed_length", "positive integer"),
        (dict(fixed_length=128), "fixed_length", "only used"),
        (dict(behaviour_weight="full"), "behaviour_weight", "recompute"),
        (dict(surrogate="clipcov"), "surrogate", "'clip_cov', 'dual_clip', 'kl_cov'"),
        (dict(kl_estimator="k3++"), "kl_estimator", "'k3+'"),
        (dict(rejection="icepop"), "rejection", "'geometric', 'none', 'sequence', 'token'"),
        (dict(rejection="token"), "rejection", "proximal in ('recompute', 'batch')"),
        (dict(rejection_low=0.0), "rejection_low", "> 0.0"),
        (dict(rejection_high=0.9), "rejection_high", ">= 1"),
        (dict(cov_fraction=0.0), "cov_fraction", "> 0.0"),
        (dict(clip_cov_low=5.0, clip_cov_high=1.0), "clip_cov_high", "> 5.0"),
    ],
)
def test_loss_config_names_the_bad_field_and_the_allowed_values(kwargs, field, allowed):
    with pytest.raises(ValueError, match=field) as err:
        LossConfig(**kwargs)
    assert allowed in str(err.value)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(estimator="ppo"), "estimator"),
        (dict(eps=0.0), "eps"),
        (dict(gamma=1.5), "gamma"),
        (dict(lam=-0.1), "lam"),
        (dict(kl_in_reward_coef=0.1), "kl_in_reward_coef"),
        (dict(group_of_one="one"), "group_of_one"),
        (dict(convention="trl"), "convention"),
    ],
)
def test_advantage_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AdvantageConfig(**kwargs)


def test_unknown_names_fail_in_one_line_naming_the_field_and_the_registered_ones():
    from rlaxkit.config.run import AlgorithmSpec

    for slot, bad, allowed in [
        ("loss", {"surrogate": "clipcov"}, SURROGATES.names()),
        ("loss", {"rejection": "icepop", "proximal": "recompute"}, REJECTION_MASKS.names()),
        ("advantage", {"group_of_one": "one"}, ("zero", "reward")),
    ]:
        with pytest.raises(ValueError) as err:
            AlgorithmSpec(preset="dapo", **{slot: bad})
        message = str(err.value)
        assert "\n" not in message and next(iter(bad)) in message, message
        assert all(repr(name) in message for name in allowed), message


def test_algorithm_config_checks_critic_consistency():
    with pytest.raises(ValueError, match="value_coef"):
        AlgorithmConfig(advantage=AdvantageConfig(estimator="gae"))
    with pytest.raises(ValueError, match="value_coef"):
        AlgorithmConfig(loss=LossConfig(value_coef=0.5))
    with pytest.raises(ValueError, match="name"):
        AlgorithmConfig(name="")


def test_registry_rejects_duplicates_and_lists_names():
    registry = Registry[int]("thing")
    registry.register("a")(1)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a")(2)
    with pytest.raises(ValueError, match=r"unknown thing 'b'; registered: \('a',\)"):
        registry.get("b")
    assert list(registry) == ["a"] and "a" in registry


def test_a_run_samples_each_prompt_once_only_with_the_reward_baseline():
    from rlaxkit.config.run import small_run_config

    with pytest.raises(ValueError, match="group_of_one=reward"):
        small_run_config("sampling.n=1", "algorithm.preset=dapo")
    config = small_run_config(
        "sampling.n=1", "algorithm.preset=dapo", "algorithm.advantage.group_of_one=reward"
    )
    assert config.sampling.n == 1
