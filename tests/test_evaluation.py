"""pass@k, mean@k, maj@k and policy evaluation."""

import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlaxkit.config import small_run_config
from rlaxkit.evaluation import (
    EvalReport,
    eval_batch_prompts,
    evaluate_model,
    evaluate_policy,
    maj_at_k,
    mean_at_k,
    pass_at_k,
)
from rlaxkit.tasks import RewardRunner, evaluate_expression, make_task


def brute_force_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Share of all k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_pass_at_k_equals_enumeration_over_all_subsets(data):
    n = data.draw(st.integers(1, 10))
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    assert pass_at_k(n, c, k) == pytest.approx(float(brute_force_pass_at_k(n, c, k)), abs=1e-12)


def test_pass_at_k_hand_values_and_edges():
    assert pass_at_k(4, 1, 2) == 0.5  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is c/n
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 6, 5) == 1.0  # n - c < k: every subset has a correct sample
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)


def test_pass_at_k_is_stable_for_large_n():
    # C(2000, 1000) overflows a float; the product form does not need it.
    n, c, k = 2000, 3, 1000
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


def test_mean_at_k():
    assert mean_at_k([1.0, 0.0, 0.5, 0.5], 2) == 0.5
    with pytest.raises(ValueError, match="1 <= k <= n"):
        mean_at_k([1.0], 2)


def test_maj_at_k_hand_values():
    answers = ["4", "4", "5", None]
    correct = [True, True, False, False]
    assert maj_at_k(answers, correct, 4) == 1.0  # "4" wins 2 to 1
    # k=1: the single vote is correct for 2 of 4 samples; None abstains (counts wrong).
    assert maj_at_k(answers, correct, 1) == 0.5
    # k=2 subsets: {4,4} {4,5}x2 {4,None}x2 {5,None}; the tie {4,5} goes to the sampled-first 4.
    assert maj_at_k(answers, correct, 2) == 5 / 6
    assert maj_at_k(["5", "5", "4"], [False, False, True], 3) == 0.0


def test_maj_at_k_sampling_approximates_enumeration():
    answers = [str(i % 3) for i in range(14)]
    correct = [a == "0" for a in answers]
    exact = maj_at_k(answers, correct, 5)
    sampled = maj_at_k(answers, correct, 5, max_subsets=1000, seed=1)
    assert sampled == pytest.approx(exact, abs=0.05)
    assert sampled == maj_at_k(answers, correct, 5, max_subsets=1000, seed=1)


def arithmetic_policy(prompts: list[str], n: int, seed: int) -> list[list[str]]:
    """Sample j of a prompt is right iff j < (answer mod (n + 1)): a known pass rate."""
    out = []
    for prompt in prompts:
        answer = evaluate_expression(prompt.rstrip("="))[0].numerator
        right = answer % (n + 1)
        out.append([str(answer) if j < right else str(answer + 1 + j) for j in range(n)])
    return out


def test_evaluate_policy_matches_hand_computed_metrics():
    task = make_task("arithmetic")
    problems = task.problems("test", 12)
    report = evaluate_policy(task, arithmetic_policy, problems=problems, n=4, ks=(1, 2, 4))
    rights = [p.answer % 5 for p in problems]
    assert [r["k"] for r in report.rows] == [1, 2, 4]
    for row in report.rows:
        expected = sum(pass_at_k(4, min(c, 4), row["k"]) for c in rights) / 12
        assert row["pass@k"] == pytest.approx(expected)
        assert row["mean@k"] == pytest.approx(sum(min(c, 4) / 4 for c in rights) / 12)
    # The wrong answers are all different, so one right answer wins any vote it is in.
    assert report.rows[-1]["maj@k"] == pytest.approx(sum(c > 0 for c in rights) / 12)
    assert [p["correct"] for p in report.per_problem] == [min(c, 4) for c in rights]
    table = report.table()
    assert table.splitlines()[0] == "arithmetic: 12 problems, 4 samples each"
    assert "pass@k" in table and str(report) == table


def test_evaluate_policy_on_code_reports_nan_majority():
    task = make_task("code")
    problems = task.problems("test", 2)

    def policy(prompts, n, seed):
        return [[task.demonstration(p)] * n for p in problems]

    with RewardRunner.for_task(task, "inline") as runner:
        report = evaluate_policy(task, policy, problems=problems, n=2, ks=(1,), runner=runner)
    assert isinstance(report, EvalReport)
    assert report.rows[0]["pass@k"] == 1.0 and math.isnan(report.rows[0]["maj@k"])


def test_evaluate_policy_checks_its_inputs():
    task = make_task("arithmetic")
    with pytest.raises(ValueError, match="ks must be in"):
        evaluate_policy(task, arithmetic_policy, num_problems=2, n=2, ks=(1, 4))

    def short_policy(prompts, n, seed):
        return [["1"] * (n - 1) for _ in prompts]

    with pytest.raises(ValueError, match="expected 3 each"):
        evaluate_policy(task, short_policy, num_problems=2, n=3, ks=(1,))


def test_evaluate_model_samples_in_batches_with_a_bar_and_reports_what_one_call_does(capsys):
    """The evaluation's progress bar moves a batch of problems at a time; its report is the
    one of sampling every problem in one call (the evaluation before it had a bar)."""
    from rlaxkit.inference import make_text_generate
    from rlaxkit.runtime.build import build_policy, build_task

    config = small_run_config("task.options.max_digits=2")  # one digit: 9 test problems
    task = build_task(config)
    model, tokenizer = build_policy(config, task)
    problems = task.problems("test", 40)
    assert eval_batch_prompts(len(problems), 4) == 32  # 160 rows: batches of 32 and 8 problems
    report = evaluate_model(
        config, task, model, tokenizer, problems=problems, n=4, seed=5, progress=True
    )
    one_call = make_text_generate(model, tokenizer, config.sampling)
    assert report == evaluate_policy(task, one_call, problems=problems, n=4, ks=(1, 4), seed=5)
    assert sum(report.reasons.values()) > 0  # the completions differ in how they fail
    err = capsys.readouterr().err
    assert "eval:" in err and f"32/{len(problems)} [" in err
