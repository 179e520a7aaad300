"""Final-answer math through math-verify: extraction and equivalence, table-driven."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlaxkit.tasks import (
    NO_ANSWER,
    WRONG_ANSWER,
    MathConfig,
    MathTask,
    Problem,
    extract_answer,
    extract_boxed,
    make_task,
)

# (reference answer, completion, expected score, expected reason)
CASES = [
    # fractions, decimals and LaTeX forms of the same number
    ("11/12", r"so the sum is $\boxed{\frac{11}{12}}$.", 1.0, None),
    ("0.5", r"\boxed{\dfrac{1}{2}}", 1.0, None),
    ("3/4", r"\boxed{0.75}", 1.0, None),
    ("-11/20", r"\boxed{-\frac{11}{20}}", 1.0, None),
    (r"\frac{\pi}{2}", r"\boxed{\pi/2}", 1.0, None),
    (r"3\sqrt{2}", r"\boxed{\sqrt{18}}", 1.0, None),
    ("x^2+1", r"\boxed{1 + x^2}", 1.0, None),
    ("2", r"\boxed{2.0}", 1.0, None),
    # units and currency are stripped
    ("5", r"\boxed{5\text{ cm}}", 1.0, None),
    ("10", r"\boxed{10 \text{ dollars}}", 1.0, None),
    ("18", r"\boxed{\$18}", 1.0, None),
    ("50", r"\boxed{50\%}", 1.0, None),  # math-verify accepts 50% for "50" (percent questions)
    # GSM8K answers: '#### x', thousands separators, a leading '$'
    ("1000", "She earns 1,000 dollars.\n#### 1,000", 1.0, None),
    ("72", "48 + 24 = 72\n#### $72", 1.0, None),
    # the last box wins; nested braces are balanced
    ("7", r"first \boxed{3}, corrected: \boxed{7}", 1.0, None),
    (r"\frac{1}{3}", r"\fbox{\frac{1}{3}}", 1.0, None),
    # wrong answers
    ("12", r"\boxed{13}", 0.0, WRONG_ANSWER),
    ("1/2", r"\boxed{1/3}", 0.0, WRONG_ANSWER),
    ("-3", r"\boxed{3}", 0.0, WRONG_ANSWER),
    ("11/12", r"\boxed{\frac{12}{11}}", 0.0, WRONG_ANSWER),
    # nothing to read
    ("5", "The answer is 5.", 0.0, NO_ANSWER),
    ("2", r"\boxed{\frac{1}{2", 0.0, NO_ANSWER),  # cut off inside the box
    ("2", r"\boxed{}", 0.0, NO_ANSWER),
]


@pytest.fixture(scope="module")
def task():
    return MathTask()


@pytest.mark.parametrize(("reference", "completion", "score", "reason"), CASES)
def test_math_answers(task, reference, completion, score, reason):
    result = task.score(Problem(id="m", prompt="q", answer=reference), completion)
    assert (result.score, result.reason) == (score, reason)


def test_gsm8k_reference_solutions_are_reduced_to_their_final_answer(task):
    reference = "Natalia sold 48/2 = 24 clips in May.\n48+24 = 72 clips.\n#### 72"
    problem = Problem(id="g", prompt="q", answer=reference)
    assert task.score(problem, r"\boxed{72}").score == 1.0
    assert task.score(problem, r"\boxed{24}").score == 0.0


def test_last_number_fallback():
    task = make_task("math", answer_fallback="last_number")
    problem = Problem(id="m", prompt="q", answer="1200")
    assert task.score(problem, "so she pays 1,200 in total.").score == 1.0
    assert task.score(problem, "no numbers here").reason == NO_ANSWER


def test_extractors():
    assert extract_boxed(r"a \boxed{\frac{1}{\sqrt{2}}} b") == r"\frac{1}{\sqrt{2}}"
    assert extract_boxed("no box") is None
    assert extract_answer("#### 1,234.") == "1234"
    assert extract_answer("3 then 4") is None
    assert extract_answer("3 then 4", fallback="last_number") == "4"


def test_synthetic_problems_and_prompt():
    task = MathTask(MathConfig(seed=1))
    problems = task.problems("train", 30)
    assert {p.metadata["kind"] for p in problems} == {"fractions", "percent", "linear"}
    assert task.format_prompt(problems[0]).endswith("Put the final answer in \\boxed{}.")
    for problem in problems[:6]:
        assert task.score(problem, task.demonstration(problem)).score == 1.0


@settings(max_examples=30, deadline=None)
@given(completion=st.text(alphabet="0123456789/.-+x{}^ \\boxedfrac#$%,", max_size=30))
def test_reward_in_range_for_any_text(task, completion):
    result = task.score(Problem(id="m", prompt="q", answer="3/4"), completion)
    assert result.score in (0.0, 1.0)
    assert (result.reason is None) == (result.score == 1.0)


def test_config_errors_name_the_field():
    with pytest.raises(
        ValueError, match=r"answer_fallback must be one of \['none', 'last_number'\]"
    ):
        MathConfig(answer_fallback="first")
    with pytest.raises(ValueError, match="test_path needs a train_path"):
        MathConfig(test_path="x.jsonl")
