"""The calculator task: the safe evaluator agrees with Python and refuses everything else,
the environment answers tool calls and scores final answers, tool-use metrics, and the
same task without its tool."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rlaxkit.config.run import RunConfig
from rlaxkit.tasks import (
    CalcError,
    CalculatorEnvironment,
    CalculatorTask,
    calculate,
    called_tool_correctly,
    make_task,
    task_names,
    tool_use_metrics,
)
from rlaxkit.tasks.calculator import MAX_CALC_CHARS, MAX_CALC_VALUE, CalculatorConfig, render
from rlaxkit.tasks.episodes import Action, Episode, StepRecord

CONFIGS = Path(__file__).parents[1] / "configs"


@st.composite
def expressions(draw, depth=3):
    """Arithmetic text over small ints and floats, with and without parentheses."""
    if depth == 0 or draw(st.booleans()):
        number = draw(st.integers(0, 999) | st.floats(0, 999, allow_nan=False).map(round2))
        return str(number)
    left, right = draw(expressions(depth=depth - 1)), draw(expressions(depth=depth - 1))
    op = draw(st.sampled_from(["+", "-", "*", "/", "//", "%"]))
    text = f"{left}{op}{right}"
    if draw(st.booleans()):
        text = f"({text})"
    return f"-{text}" if draw(st.booleans()) and text.startswith("(") else text


def round2(x):
    return round(x, 2)


@settings(max_examples=300, deadline=None)
@given(expressions())
def test_calculate_agrees_with_python_arithmetic(text):
    # The test's own input is trusted: Python's evaluation is the reference. Literals
    # below 1000 and depth 3 keep every value far below MAX_CALC_VALUE.
    assume(len(text) <= MAX_CALC_CHARS)
    try:
        expected = eval(text, {"__builtins__": {}})  # noqa: S307
    except ZeroDivisionError:
        with pytest.raises(CalcError, match="division by zero"):
            calculate(text)
        return
    got = calculate(text)
    assert type(got) is type(expected) and got == expected


REFUSED = [
    "x",
    "abs(3)",
    "(1).real",
    "__import__('os').system('true')",
    "2**10",
    "9**9**9",
    "[1, 2]",
    "1 if 1 else 2",
    "'a' * 3",
    "True + 1",
    "1e400",
    "+5",
    "3 < 4",
    "lambda: 1",
    "1; 2",
    "",
    "1 +",
    "(" * 40 + "1" + ")" * 40,
]


@pytest.mark.parametrize("text", REFUSED)
def test_calculate_refuses_names_calls_powers_and_non_arithmetic(text):
    with pytest.raises(CalcError):
        calculate(text)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 10**9), st.integers(1, 10**9), st.integers(1, 10**9))
def test_calculate_refuses_values_past_the_bound(a, b, c):
    text = f"{a}*{b}*{c}"
    if a * b <= MAX_CALC_VALUE and a * b * c <= MAX_CALC_VALUE:
        assert calculate(text) == a * b * c
    else:
        with pytest.raises(CalcError, match="too large"):
            calculate(text)


@given(st.integers(0, 10**6), st.integers(0, 10**6), expressions(depth=1))
def test_calculate_refuses_every_power(base, exponent, rest):
    with pytest.raises(CalcError, match="only numbers"):
        calculate(f"{base}**{exponent}")
    with pytest.raises(CalcError, match="only numbers"):
        calculate(f"({rest})**{exponent}")


@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.()'", min_size=1, max_size=20))
def test_calculate_refuses_any_name(text):
    with pytest.raises(CalcError):
        calculate(f"1 + {text}")


def test_render():
    assert [render(v) for v in (391, 4.0, 0.25, 1 / 3, -7)] == [
        "391",
        "4",
        "0.25",
        "0.333333",
        "-7",
    ]


def test_task_is_registered_and_its_problems_are_three_by_two_digit_products():
    assert "calculator" in task_names()
    task = make_task("calculator", seed=1)
    train, test = task.problems("train", 50), task.problems("test", 5)
    assert not {p.id for p in train} & {p.id for p in test}
    for problem in train:
        a, b = problem.metadata["expression"].split("*")
        assert (len(a), len(b)) == (3, 2)
        assert problem.prompt == f"{a}*{b}=" and problem.answer == int(a) * int(b)


def test_score_reads_the_answer_after_the_last_observation():
    task = CalculatorTask()
    problem = task.problems("train", 1)[0]
    assert task.score(problem, task.demonstration(problem)).score == 1.0
    assert task.score(problem, f"{problem.answer}\nmore").score == 1.0  # no tool call
    assert task.score(problem, "<calc>1+1</calc>=2\n2").reason == "wrong_answer"
    assert task.score(problem, "<calc>1+1</calc>=2\n").reason == "no_answer"


def test_environment_answers_calls_refuses_bad_ones_and_scores_the_final_turn():
    task = CalculatorTask()
    problem = task.problems("train", 1)[0]
    env = CalculatorEnvironment(task)
    assert env.tool_stops == ("</calc>",)
    assert env.reset(problem) == problem.prompt
    ok = env.step(Action("<calc>17*23</calc>", (), "stop"))
    assert (ok.observation, ok.done, ok.reward, ok.info["value"]) == ("=391\n", False, 0.0, 391)
    bad = env.step(Action("<calc>os.system(1)</calc>", (), "stop"))
    assert bad.observation == "=error: only numbers and + - * / // % are allowed\n"
    assert bad.info["ok"] is False and not bad.done
    assert env.step(Action("1/0</calc>", (), "stop")).observation == "=error: no call\n"
    assert env.error_observation("timeout", "") == "=error: tool timed out\n"
    final = env.step(Action(str(problem.answer), (), "stop"))
    assert final.done and final.reward == 1.0 and final.info["correct"]
    assert env.step(Action("12", (), "length")).reward == 0.0
    assert set("".join([ok.observation, bad.observation])) <= set(task.alphabet())


def test_without_the_tool_a_call_is_an_error_and_the_demonstration_the_answer():
    task = CalculatorTask(CalculatorConfig(tool=False))
    problem = task.problems("train", 1)[0]
    assert task.problems("train", 1) == CalculatorTask().problems("train", 1)
    assert task.demonstration(problem) == str(problem.answer)
    env = CalculatorEnvironment(task)
    env.reset(problem)
    call = env.step(Action(task.demonstration_turns(problem)[0], (), "stop"))
    assert call.observation == "=error: no calculator\n" and not call.done
    assert call.info == {"tool": "calc", "ok": False}  # a call, refused: tool_error_rate
    final = env.step(Action(str(problem.answer), (), "stop"))
    assert final.done and final.info["correct"]
    # The same model: one alphabet (the char tokenizer, vocab_size 50) with or without.
    assert task.alphabet() == CalculatorTask().alphabet()
    assert set(call.observation) <= set(task.alphabet()) and len(task.alphabet()) + 3 <= 50


def test_the_no_tool_config_is_the_tool_config_without_the_tool():
    tool = RunConfig.from_yaml(CONFIGS / "calculator_tools.yaml").to_dict()
    no_tool = RunConfig.from_yaml(CONFIGS / "calculator_no_tool.yaml").to_dict()
    assert tool["task"]["options"].pop("tool", True) is True
    assert no_tool["task"]["options"].pop("tool") is False
    assert tool == no_tool


def episode_with(problem, *infos, reward=0.0):
    steps = [StepRecord(Action("", (), "stop"), "ok", 0.0, False, (), info) for info in infos]
    return Episode(problem, 0, np.ones(1, np.int32), steps=steps, reward=reward)


def test_tool_use_metrics():
    task = CalculatorTask()
    problem = task.problems("train", 1)[0]
    right = {"tool": "calc", "ok": True, "value": int(problem.answer)}
    wrong = {"tool": "calc", "ok": True, "value": 3}
    refused = {"tool": "calc", "ok": False}
    episodes = [
        episode_with(problem, right, {"final": True}, reward=1.0),
        episode_with(problem, refused, wrong),
        episode_with(problem, {"final": True}),
        episode_with(problem),
    ]
    assert [called_tool_correctly(e) for e in episodes] == [True, False, False, False]
    assert tool_use_metrics(episodes) == {
        "tool_use_rate": 0.25,
        "tool_call_rate": 0.5,
        "tool_error_rate": 1 / 3,
        "pass_rate": 0.25,
        "calls_per_episode": 0.75,
    }


def test_tasks_and_the_environment_contract_import_without_jax():
    # Reward pools and light tools import rlaxkit.tasks; the episode driver's JAX waits.
    code = (
        "import sys, rlaxkit.tasks, rlaxkit.tasks.episodes;"
        "bad = [m for m in ('jax', 'flax') if m in sys.modules];"
        "sys.exit(repr(bad) if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"first_digits": 0}, "first_digits"),
        ({"second_digits": "two"}, "second_digits"),
        ({"call_close": ""}, "call_open and call_close"),
        ({"test_fraction": 2.0}, "test_fraction"),
        ({"tool": "no"}, "tool"),
    ],
)
def test_config_errors_name_the_field(options, message):
    with pytest.raises(ValueError, match=rf"task 'calculator' options: {message}"):
        make_task("calculator", **options)
