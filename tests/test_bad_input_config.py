"""Bad config input gets an error naming the field and the fix; a config file merges onto
the run's defaults exactly as ``--set`` overrides do."""

import pytest

from rlaxkit.config.io import apply_overrides, merge
from rlaxkit.config.run import RunConfig, small_run_config
from rlaxkit.tasks import make_task


def _from_yaml(tmp_path, text, overrides=()):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return RunConfig.from_yaml(path, list(overrides))


def _from_set(*overrides):
    return RunConfig.from_dict(apply_overrides(RunConfig().to_dict(), list(overrides)))


def test_a_section_given_in_part_keeps_the_run_defaults(tmp_path):
    config = _from_yaml(tmp_path, "sampling: {n: 4}\noptimizer: {learning_rate: 0.001}\n")
    # The run's defaults (RunConfig's factories), not SamplingConfig's / OptimizerConfig's.
    assert config.sampling.max_new_tokens == RunConfig().sampling.max_new_tokens == 8
    assert config.optimizer.warmup_steps == RunConfig().optimizer.warmup_steps == 10
    assert config == _from_set("sampling.n=4", "optimizer.learning_rate=0.001")


def test_task_options_given_in_part_merge_like_set(tmp_path):
    config = _from_yaml(tmp_path, "task: {options: {max_digits: 3}}\n")
    assert config == _from_set("task.options.max_digits=3")
    assert config.task.options["operators"] == ["+"]


def test_a_file_naming_another_task_starts_from_no_options(tmp_path):
    config = _from_yaml(tmp_path, "task: {name: countdown}\n")
    assert config.task.options == {}
    make_task(config.task.name, **config.task.options)


def test_a_section_with_only_a_bad_field_gets_the_field_error(tmp_path):
    with pytest.raises(ValueError) as from_file:
        _from_yaml(tmp_path, "staleness: {max_staleness: -1}\n")
    with pytest.raises(ValueError) as from_set:
        _from_set("staleness.max_staleness=-1")
    assert str(from_file.value) == str(from_set.value)
    assert "config.staleness: max_staleness: must be an integer >= 0, got -1" in str(
        from_file.value
    )


def test_merge_leaves_its_arguments_alone():
    defaults = {"a": {"b": 1}}
    merged = merge(defaults, {"a": {"c": 2}})
    merged["a"]["b"] = 5
    assert defaults == {"a": {"b": 1}} and merged == {"a": {"b": 5, "c": 2}}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "task.options.max_digits=two",
            r"config\.task: task 'arithmetic' options: max_digits: must be an integer in "
            r"\[1, 18\], got 'two'",
        ),
        ("task.options.max_digits=2.0", r"max_digits: must be an integer in \[1, 18\], got 2\.0"),
        ("task.options.num_operands=1", r"num_operands: must be an integer >= 2, got 1"),
        ("task.options.operators=+", r"operators: expected a list, got '\+'"),
        ("task.options.question_template=5", r"question_template: expected str, got 5"),
        ("task.options.test_fraction=half", r"test_fraction must be a number in \[0\.0, 1\.0\]"),
        ("task.options.digits=2", r"unknown option\(s\) \['digits'\] for task 'arithmetic'"),
        ("task.name=nope", r"config\.task: unknown task 'nope'; registered tasks: \["),
        ("task.num_train=0", r"config\.task: num_train: must be an integer >= 1, got 0"),
    ],
)
def test_bad_task_options_are_refused_when_the_config_is_read(override, message):
    with pytest.raises(ValueError, match=message):
        small_run_config(override)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("countdown", {"max_numbers": "4"}, r"max_numbers: must be an integer in \[2, 8\]"),
        ("countdown", {"max_target": 0}, r"max_target: must be an integer >= 1, got 0"),
        ("code", {"max_total_s": "long"}, r"max_total_s: must be a number > 0 \(seconds\)"),
        ("code", {"limits": {"wall_time_s": "x"}}, r"limits\.wall_time_s: expected a number"),
        ("math", {"verify_timeout_s": 0}, r"verify_timeout_s: must be an integer >= 1"),
        ("math", {"seed": "zero"}, r"seed: must be an integer, got 'zero'"),
    ],
)
def test_every_task_checks_its_options(name, options, message):
    with pytest.raises(ValueError, match=rf"task '{name}' options: {message}"):
        make_task(name, **options)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.preset=nope", r"config\.algorithm: preset: unknown algorithm preset 'nope'"),
        ("algorithm.loss.nope=1", r"config\.algorithm: loss: unknown field\(s\) \['nope'\]"),
        ("algorithm.loss.clip_eps_low=-1", r"config\.algorithm: grpo: clip_eps_low"),
        ("batching.order=newest", r"config\.batching\.order: must be one of"),
    ],
)
def test_the_algorithm_is_checked_when_the_config_is_read(override, message):
    """A bad preset or slot fails before a run makes its folder or warms up."""
    with pytest.raises(ValueError, match=message):
        small_run_config(override)


def test_set_naming_another_task_starts_it_from_no_options():
    """--set task.name=countdown: the default options are arithmetic's, so they go, as
    they do for a file that names another task."""
    assert small_run_config("task.name=countdown").task.options == {}
    config = small_run_config("task.name=countdown", "task.options.max_numbers=3")
    assert config.task.options == {"max_numbers": 3}


def test_a_vocabulary_smaller_than_the_tasks_tokenizer_is_refused():
    from rlaxkit.runtime.build import build_policy, build_task

    config = small_run_config("task.name=countdown")
    with pytest.raises(ValueError, match=r"model\.config\.vocab_size: 16, but task 'countdown'"):
        build_policy(config, build_task(config))


def test_the_cli_docstring_names_configs_that_exist():
    import re
    from pathlib import Path

    import rlaxkit.cli

    root = Path(rlaxkit.cli.__file__).resolve().parents[1]
    named = set(re.findall(r"configs/[\w/]+\.yaml", rlaxkit.cli.__doc__ or ""))
    assert named and all((root / path).is_file() for path in named), named


@pytest.mark.parametrize(
    ("bad", "message", "bound"),
    [
        (
            {"staleness.max_staleness": 0, "weight_sync.push_every_steps": 2},
            r"weight_sync\.push_every_steps - 1 \(1\) or admission deadlocks, got 0",
            1,
        ),
        (
            {
                "staleness.max_staleness": 1,
                "staleness.max_worker_lag": 1,
                "weight_sync.push_every_steps": 2,
            },
            r"staleness\.max_worker_lag \+ weight_sync\.push_every_steps - 1 \(2\), got 1",
            2,
        ),
    ],
    ids=["pushes_every_2_steps", "and_a_worker_lag_of_1"],
)
def test_a_staleness_bound_admission_or_pulls_cannot_meet_is_refused_as_in_the_simulator(
    bad, message, bound
):
    """With pushes every k steps the trainer runs up to k - 1 versions ahead of the
    published one that admission counts, and a worker keeps weights up to
    ``max_worker_lag`` (L) versions behind it: with η < L + k - 1 a fleet that lags
    together makes only rollouts too stale to train on (the runtime stopped after its
    first steps or after 200 stale groups, the simulator ran for ever). Both refuse it,
    with the same words, and accept η = L + k - 1."""
    import sim

    message = rf"^(config: )?staleness\.max_staleness: must be >= .*{message}"
    with pytest.raises(ValueError, match=message):
        small_run_config(*(f"{k}={v}" for k, v in bad.items()))
    with pytest.raises(ValueError, match=message):
        sim.with_overrides(sim.presets.toy(), bad)
    good = {**bad, "staleness.max_staleness": bound}
    small_run_config(*(f"{k}={v}" for k, v in good.items()))
    sim.with_overrides(sim.presets.toy(), good)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # Adam divides by 1 - b^t: a decay of 1 turns the first update into NaN.
        ("optimizer.b1=1.0", r"config\.optimizer: b1: must be in \[0, 1\)"),
        ("optimizer.b2=1.0", r"config\.optimizer: b2: must be in \[0, 1\)"),
        ("optimizer.learning_rate=inf", r"config\.optimizer: learning_rate: must be a finite"),
        ("optimizer.eps=inf", r"config\.optimizer: eps: must be a finite"),
        ("optimizer.weight_decay=inf", r"config\.optimizer: weight_decay: must be a finite"),
        ("sft.learning_rate=inf", r"config\.sft: learning_rate must be a finite"),
        ("sft.weight_decay=-1", r"config\.sft: weight_decay: must be a finite number >= 0"),
        ("sft.weight_decay=nan", r"config\.sft: weight_decay: must be a finite number >= 0"),
        # The fault clock is rounds · round_s: NaN at round 0 and infinite after, so every
        # timed fault of a plan fired at once in the first rounds.
        ("runtime.round_s=inf", r"config\.runtime: round_s must be a finite number > 0"),
        ("model.config.rms_norm_eps=inf", r"config\.model\.config: rms_norm_eps must be a fin"),
        # 0 samples failed inside the evaluation ("ks must be in [1, n=0]"), 0 problems
        # reported a pass@1 of 0.0 over nothing, -1 asked the task for -1 problems.
        ("eval.samples=0", r"config\.eval: samples: must be an integer >= 1, got 0"),
        ("eval.num_problems=-1", r"config\.eval: num_problems: must be an integer >= 1"),
        ("eval.every_steps=-1", r"config\.eval: every_steps: must be an integer >= 0"),
        # Every sample of a group the same: the run stalled after 200 filtered groups.
        ("sampling.temperature=0", r"sampling\.temperature is 0: every sample of a prompt"),
        ("sampling.top_k=1", r"sampling\.top_k is 1: every sample of a prompt"),
    ],
)
def test_values_a_run_cannot_use_are_refused_when_the_config_is_read(override, message):
    """Each was accepted before, and the run then failed later, stalled, trained on NaN
    or reported a figure over nothing: a sweep of odd values over every field of the
    small run's config found them."""
    with pytest.raises(ValueError, match=message):
        small_run_config(override)


def test_greedy_sampling_stays_allowed_where_no_group_is_compared():
    config = small_run_config("algorithm.preset=ppo", "sampling.temperature=0")
    assert config.sampling.greedy
    small_run_config("sampling.top_k=2", "optimizer.b1=0", "optimizer.b2=0")


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "calculator"])
@pytest.mark.parametrize(("fraction", "empty"), [(0.0, "test"), (1.0, "train")])
def test_a_generated_task_refuses_a_split_that_would_be_empty(name, fraction, empty):
    """Generated problems are split by a hash of their content: at 0 or 1 one split is
    empty, and the run failed when it first drew from it ("found only 0 distinct ...
    widen the generator settings"), after the warm start."""
    message = rf"test_fraction must be strictly between 0 and 1, got {fraction}: the {empty}"
    with pytest.raises(ValueError, match=message):
        make_task(name, test_fraction=fraction)
