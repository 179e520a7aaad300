"""The countdown verifier: exact, ast-based, and closed to anything but arithmetic."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlaxkit.tasks import (
    INVALID_EXPRESSION,
    NO_ANSWER,
    NUMBER_MISUSE,
    WRONG_ANSWER,
    CountdownConfig,
    CountdownTask,
    ExpressionError,
    Problem,
    check_solution,
    evaluate_expression,
)

NUMBERS = [2, 3, 7, 25]


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os')", INVALID_EXPRESSION),
        ("__import__('os').system('true')", INVALID_EXPRESSION),
        ("(25).real", INVALID_EXPRESSION),  # attribute access
        ("().__class__", INVALID_EXPRESSION),
        ("[2, 3][0]", INVALID_EXPRESSION),
        ("2 ** 3", INVALID_EXPRESSION),  # no ** at all, small or huge
        ("9 ** 9 ** 9 ** 9", INVALID_EXPRESSION),
        ("7 // 2", INVALID_EXPRESSION),
        ("7 % 2", INVALID_EXPRESSION),
        ("-7 + 25", INVALID_EXPRESSION),  # unary minus
        ("2.5 * 2", INVALID_EXPRESSION),
        ("True + 2", INVALID_EXPRESSION),
        ("lambda: 1", INVALID_EXPRESSION),
        ("x + 1", INVALID_EXPRESSION),
        ("2 +", INVALID_EXPRESSION),
        ("25 / (3 - 3)", INVALID_EXPRESSION),  # 3 used twice as well, division by zero first
        ("(" * 200 + "2" + ")" * 200, INVALID_EXPRESSION),  # longer than the cap
        ("25 + 25", NUMBER_MISUSE),  # reused number
        ("25 * 4", NUMBER_MISUSE),  # number not given
        ("25 + 7", WRONG_ANSWER),
    ],
)
def test_verifier_rejects(expression, reason):
    result = check_solution(expression, NUMBERS, 100)
    assert result.score == 0.0
    assert result.reason == reason


@pytest.mark.parametrize("expression", ["25 * (7 - 3)", "(7-3)*25", "(4 + 4 - 7 + 3) * 25"])
def test_verifier_accepts_valid_solutions(expression):
    numbers = [2, 3, 4, 4, 7, 25]  # 4 given twice may be used twice
    assert check_solution(expression, numbers, 100).score == 1.0


def test_exact_rational_arithmetic():
    assert evaluate_expression("7 / 2 * 2") == (Fraction(7), [7, 2, 2])
    assert check_solution("(2 + 7 / 3) * 3", [2, 7, 3, 3], 13).score == 1.0
    # 1/3 * 3 is exactly 1, not 0.9999...
    assert check_solution("(3 / 9) * 9 * 25", [3, 9, 9, 25], 75).score == 1.0
    with pytest.raises(ExpressionError, match="division by zero"):
        evaluate_expression("1 / (2 - 2)")


def test_completion_parsing():
    task = CountdownTask()
    problem = Problem(id="c", prompt="2,3,7,25->100:", answer=100, metadata={"numbers": NUMBERS})
    assert task.score(problem, "25*(7-3)").score == 1.0
    assert task.score(problem, "25*(7-3) = 100\nthinking...").score == 1.0
    assert task.score(problem, "let me see <answer>(7 - 3) * 25</answer>").score == 1.0
    assert task.score(problem, "<answer>1</answer> then <answer>25*(7-3)</answer>").score == 1.0
    assert task.score(problem, "").reason == NO_ANSWER
    assert task.score(problem, "\n25*(7-3)").reason == NO_ANSWER


def test_generated_problems_carry_a_valid_solution():
    task = CountdownTask(CountdownConfig(seed=3))
    for problem in task.problems("train", 100) + task.problems("test", 20):
        assert 1 <= problem.answer <= task.config.max_target
        assert task.score(problem, task.demonstration(problem)).score == 1.0
        assert task.format_prompt(problem).endswith(f"->{problem.answer}:")


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet="0123456789+-*/() .,_aeiosx[]'\"=<>:", max_size=40))
def test_reward_in_range_for_any_text(text):
    task = CountdownTask()
    problem = Problem(id="c", prompt="", answer=100, metadata={"numbers": NUMBERS})
    result = task.score(problem, text)
    assert result.score in (0.0, 1.0)
    assert (result.reason is None) == (result.score == 1.0)
