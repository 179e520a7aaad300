"""Curation: pass-rate estimation, band filtering, dedup, curriculum, held-out splits."""

import dataclasses
import json

import pytest

from rlaxkit.tasks import (
    CurationConfig,
    Problem,
    curate,
    dedup,
    estimate_pass_rates,
    evaluate_expression,
    filter_by_pass_rate,
    holdout_split,
    load_problems,
    make_task,
    normalise_text,
    order_by_difficulty,
    write_curated,
)

K = 16


def solved_count(answer: int) -> int:
    """How many of K samples the toy policy gets right: 0..K, spread over answers."""
    return answer % (K + 1)


def toy_policy(prompts: list[str], n: int, seed: int) -> list[list[str]]:
    """Sample j is right iff j < solved_count(answer); a deterministic, known pass rate."""
    out = []
    for prompt in prompts:
        answer = evaluate_expression(prompt.rstrip("="))[0].numerator
        out.append([str(answer) if j < solved_count(answer) else "-1" for j in range(n)])
    return out


@pytest.fixture(scope="module")
def task():
    return make_task("arithmetic", max_digits=2)


def test_pass_rates_are_exact_for_a_known_policy(task):
    problems = task.problems("train", 40)
    rates = estimate_pass_rates(task, problems, toy_policy, samples_per_prompt=K)
    for problem in problems:
        assert rates[problem.id].correct == solved_count(problem.answer)
        assert rates[problem.id].pass_rate == solved_count(problem.answer) / K


def test_band_filter_drops_always_and_never_solved(task):
    problems = task.problems("train", 80)
    rates = estimate_pass_rates(task, problems, toy_policy, samples_per_prompt=K)
    kept, too_easy, too_hard = filter_by_pass_rate(problems, rates, 0.05, 0.95)
    assert {solved_count(p.answer) for p in too_hard} == {0}
    assert {solved_count(p.answer) for p in too_easy} == {K}
    assert all(1 <= solved_count(p.answer) <= K - 1 for p in kept)
    assert len(kept) + len(too_easy) + len(too_hard) == 80


def test_curriculum_orders_by_pass_rate(task):
    problems = task.problems("train", 30)
    rates = estimate_pass_rates(task, problems, toy_policy, samples_per_prompt=K)
    easy_first = [rates[p.id].pass_rate for p in order_by_difficulty(problems, rates, "easy_first")]
    assert easy_first == sorted(easy_first, reverse=True)
    hard_first = [rates[p.id].pass_rate for p in order_by_difficulty(problems, rates, "hard_first")]
    assert hard_first == sorted(hard_first)
    assert order_by_difficulty(problems, rates, "none") == problems


def test_dedup_exact_and_normalised():
    texts = [
        "What is 2 + 2?",
        "What is 2 + 2?",
        "what is 2+2",
        "What is 2 + 3?",
        "ＷＨＡＴ is 2+2.",
    ]
    problems = [Problem(id=f"p{i}", prompt=t, answer=0) for i, t in enumerate(texts)]
    assert [p.id for p in dedup(problems, "exact")] == ["p0", "p2", "p3", "p4"]
    assert [p.id for p in dedup(problems, "normalised")] == ["p0", "p3"]
    assert dedup(problems, "none") == problems
    assert normalise_text("  A  b\tC?") == "abc"


def test_holdout_by_id_is_stable_and_disjoint(task):
    problems = task.problems("train", 200)
    config = CurationConfig(holdout_by="id", holdout_fraction=0.25)
    train, heldout = holdout_split(problems, config)
    assert not {p.id for p in train} & {p.id for p in heldout}
    assert len(train) + len(heldout) == 200 and 25 <= len(heldout) <= 75
    # The decision is per id, so order and subsets do not change it.
    again_train, again_heldout = holdout_split(problems[::-1][:100], config)
    assert {p.id for p in again_heldout} <= {p.id for p in heldout}
    assert {p.id for p in again_train} <= {p.id for p in train}


def test_holdout_by_time():
    times = ["2024-06-01", "2024-11-27T23:59:59", "2024-11-28", "2025-01-15T10:00:00+00:00", 1.8e9]
    problems = [
        Problem(id=f"p{i}", prompt=f"q{i}", answer=0, metadata={"date": t})
        for i, t in enumerate(times)
    ]
    config = CurationConfig(holdout_by="time", time_field="date", time_cutoff="2024-11-28")
    train, heldout = holdout_split(problems, config)
    assert [p.id for p in train] == ["p0", "p1"]
    assert [p.id for p in heldout] == ["p2", "p3", "p4"]
    undated = [*problems, Problem(id="x", prompt="x", answer=0)]
    with pytest.raises(ValueError, match="problem x has no metadata field 'date'"):
        holdout_split(undated, config)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="max_pass_rate must be in"):
        CurationConfig(min_pass_rate=0.5, max_pass_rate=0.4)
    with pytest.raises(ValueError, match="time_cutoff must be set"):
        CurationConfig(holdout_by="time")
    with pytest.raises(ValueError, match=r"dedup must be one of \['none', 'exact', 'normalised'\]"):
        CurationConfig(dedup="fuzzy")


def test_curate_end_to_end_writes_jsonl_and_manifest(task, tmp_path):
    problems = task.problems("train", 60)
    # Copies with extra spacing: normalised dedup must remove them.
    copies = [
        dataclasses.replace(p, id=p.id + "-copy", prompt=p.prompt.replace("=", " =  "))
        for p in problems[:5]
    ]
    config = CurationConfig(samples_per_prompt=K, holdout_by="id", holdout_fraction=0.2, seed=3)
    result = curate(task, problems + copies, toy_policy, config, source="arithmetic:train")
    counts = result.manifest["counts"]
    assert counts["input"] == 65 and counts["duplicates_removed"] == 5
    assert counts["held_out"] + counts["scored"] == 60
    assert counts["too_easy"] + counts["too_hard"] + counts["kept"] == counts["scored"]
    assert counts["kept"] == len(result.train) > 0
    rates = [p.metadata["pass_rate"] for p in result.train]
    assert rates == sorted(rates, reverse=True) and min(rates) >= 0.05 and max(rates) <= 0.95
    assert not {p.id for p in result.train} & {p.id for p in result.heldout}

    paths = write_curated(tmp_path / "curated", result)
    manifest = json.loads(paths["manifest"].read_text())
    assert manifest["source"] == "arithmetic:train" and manifest["seed"] == 3
    assert manifest["settings"]["min_pass_rate"] == 0.05
    assert manifest["counts"] == counts
    assert load_problems(paths["train"]).problems == result.train
    assert load_problems(paths["heldout"]).problems == result.heldout
    # Same inputs, same curated set.
    again = curate(task, problems + copies, toy_policy, config, source="arithmetic:train")
    assert again.train == result.train and again.manifest == result.manifest
