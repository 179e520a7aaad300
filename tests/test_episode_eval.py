"""Held-out evaluation of a multi-turn task runs episodes with the tools: pass@k counts
the episodes' final verdicts, the task's episode metrics come along, and ``rlaxkit
train`` writes them before and after RL."""

import dataclasses
import json
from pathlib import Path

import pytest
from flax import nnx

from rlaxkit.cli import main
from rlaxkit.evaluation import evaluate_episodes, make_episode_engine, pass_at_k
from rlaxkit.inference import SamplingConfig
from rlaxkit.models import CharTokenizer, ModelConfig, Transformer
from rlaxkit.tasks import CalculatorEnvironment, CalculatorTask, tool_use_metrics
from rlaxkit.tasks.episodes import Action, EpisodeConfig, StepResult, run_episodes


class EvenAnswerEnvironment(CalculatorEnvironment):
    """The calculator's environment, but a final answer of even length is right: a
    random model's episodes are then a mix of right and wrong."""

    def step(self, action: Action) -> StepResult:
        if action.text.endswith(self.task.config.call_close):
            return super().step(action)
        correct = len(action.text) % 2 == 0
        info = {"final": True, "correct": correct, "parsed": action.text, "reason": None}
        return StepResult(reward=float(correct), done=True, info=info)


class EvenAnswerTask(CalculatorTask):
    def make_environment(self) -> EvenAnswerEnvironment:
        return EvenAnswerEnvironment(self)


TASK = EvenAnswerTask()
TOKENIZER = CharTokenizer(TASK.alphabet())
EPISODES = EpisodeConfig(max_turns=2, max_episode_tokens=24, keep_cache=True)
N = 4


@pytest.fixture(scope="module")
def engine():
    config = ModelConfig(
        family="qwen3",
        vocab_size=TOKENIZER.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    model = Transformer(config, rngs=nnx.Rngs(0))
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0)
    return make_episode_engine(
        model, TASK, TOKENIZER, sampling, EPISODES, max_prompt_tokens=16, num_slots=8, chunk_steps=8
    )


def test_episode_pass_at_k_counts_the_episodes_final_verdicts(engine):
    problems = TASK.problems("test", 6)
    report = evaluate_episodes(
        TASK, engine, TOKENIZER, EPISODES, problems=problems, n=N, ks=(1, N), seed=3
    )
    # The same episodes by hand: one seed, one set of episodes.
    config = dataclasses.replace(EPISODES, samples_per_problem=N)
    episodes = run_episodes(engine, TASK.make_environment, problems, TOKENIZER, config, seed=3)
    correct = [bool(e.steps[-1].info.get("correct")) for e in episodes]
    assert 0 < sum(correct) < len(correct)  # the check below is not 0 == 0
    per_problem = [sum(correct[i * N : (i + 1) * N]) for i in range(len(problems))]
    assert [p["correct"] for p in report.per_problem] == per_problem
    # Equal n per problem: pass@1 is the share of correct episodes (up to rounding in
    # pass_at_k's product), pass@N the share of problems with any correct episode.
    assert report.rows[0]["pass@k"] == pytest.approx(sum(correct) / len(correct), abs=1e-12)
    assert report.rows[1]["pass@k"] == sum(c > 0 for c in per_problem) / len(problems)
    assert report.rows[0]["mean@k"] == pytest.approx(sum(correct) / len(correct), abs=1e-12)
    assert report.metrics == tool_use_metrics(episodes)
    assert report.metrics["pass_rate"] == sum(correct) / len(correct)
    assert "tool_use_rate" in report.table()


def test_episode_evaluation_refuses_a_single_turn_task(engine):
    from rlaxkit.tasks import ArithmeticTask

    with pytest.raises(ValueError, match="evaluate_policy"):
        evaluate_episodes(ArithmeticTask(), engine, TOKENIZER, EPISODES, n=1, ks=(1,))


def test_pass_at_1_of_equal_groups_is_the_share_correct():
    # 1 - prod_{i=n-c+1}^{n} (1 - 1/i) telescopes to c/n.
    assert pass_at_k(4, 3, 1) == pytest.approx(0.75, abs=1e-15)


# A tiny calculator job: a 2-layer, 32-wide model, no warm start (every reward is 0, so
# groups are kept), two RL steps, a few held-out problems.
TINY_CALCULATOR = [
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.num_layers=2",
    "task.num_train=16",
    "sft.steps=0",
    "steps=2",
    "sampling.n=2",
    "staleness.batch_size=2",
    "runtime.slots_per_worker=8",
    "batching.equal_rewards=keep",
    "eval.num_problems=4",
    "eval.samples=2",
]


@pytest.mark.parametrize("name", ["calculator_tools.yaml", "calculator_no_tool.yaml"])
def test_train_summary_has_tool_use_before_and_after(tmp_path, capsys, name):
    run = tmp_path / "run"
    overrides = [x for o in TINY_CALCULATOR for x in ("--set", o)]
    config = str(Path(__file__).parents[1] / "configs" / name)
    assert main(["train", config, *overrides, "--run-dir", str(run), "--no-progress"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    for key in ("pass@1", "tool_use_rate", "tool_call_rate"):
        assert 0 <= summary[f"{key}_before"] <= 1 and 0 <= summary[f"{key}_after"] <= 1
    assert summary["evals"][0]["tool_use_rate"] == summary["tool_use_rate_before"]
    out = capsys.readouterr().out
    assert "held-out pass@1 before RL" in out and "tool_use_rate" in out
    assert main(["eval", str(run)]) == 0
    assert "tool_use_rate" in capsys.readouterr().out


def test_the_tool_learning_benchmark_reports_both_runs(tmp_path, capsys, monkeypatch):
    """``benchmarks/tool_learning.py`` on the tiny job: one JSON line with both runs'
    figures (so the script cannot rot; its real figures need minutes)."""
    import importlib.util

    from rlaxkit.config.run import RunConfig

    path = Path(__file__).parents[1] / "benchmarks" / "tool_learning.py"
    spec = importlib.util.spec_from_file_location("bench_tool_learning", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shipped = bench.config_for

    def tiny(name, quick):
        return RunConfig.from_overrides(TINY_CALCULATOR, base=shipped(name, quick))

    monkeypatch.setattr(bench, "config_for", tiny)
    assert bench.main(["--quick", "--run-dir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("pass1_before_tool", "pass1_after_no_tool", "tool_use_rate_after"):
        assert 0 <= report[key] <= 1
    assert report["quick"] is True and report["wall_s_tool"] > 0
