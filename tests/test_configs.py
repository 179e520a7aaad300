"""Every shipped YAML config parses into a valid RunConfig; the default round-trips."""

from pathlib import Path

import pytest

from rlaxkit.config.run import RunConfig

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_parses(path):
    config = RunConfig.from_yaml(path)
    assert config.steps >= 0 and config.group_size >= 1


def test_demo_yaml_is_the_embedded_default():
    assert RunConfig.from_yaml(Path(__file__).parents[1] / "configs" / "demo.yaml") == RunConfig()


def test_default_round_trips_through_yaml(tmp_path):
    config = RunConfig()
    config.save(tmp_path / "c.yaml")
    assert RunConfig.from_yaml(tmp_path / "c.yaml") == config


def test_overrides_and_errors_name_the_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("staleness:\n  max_staleness: 3\n  batch_size: 8\n")
    config = RunConfig.from_yaml(path, ["runtime.num_workers=4"])
    assert config.staleness.max_staleness == 3 and config.runtime.num_workers == 4
    path.write_text("staleness:\n  max_staleness: -1\n  batch_size: 8\n")
    with pytest.raises(ValueError, match=r"config\.staleness: max_staleness"):
        RunConfig.from_yaml(path)
    path.write_text("sampling:\n  top_p: 1.5\n")
    with pytest.raises(ValueError, match=r"config\.sampling: top_p must be in"):
        RunConfig.from_yaml(path)


def test_exponent_without_a_dot_is_a_number():
    config = RunConfig.from_dict({"optimizer": {"learning_rate": "3e-3"}})
    assert config.optimizer.learning_rate == 0.003
    with pytest.raises(ValueError, match="config.optimizer.learning_rate: expected a number"):
        RunConfig.from_dict({"optimizer": {"learning_rate": "fast"}})
