"""Does on-policy distillation from a larger model beat RL from the task reward alone?
(issue #62)

1. **Teacher**: the larger tiny model (4 layers, 64 wide) on one-digit sums, a supervised
   warm start then ``--teacher-steps`` of GRPO; its held-out pass@1 is measured and its
   weights written as an HF checkpoint (what a run's ``final/`` holds).
2. **Students**: a smaller model (2 layers, 64 wide: half the teacher's depth) after a
   short warm start (100 supervised steps), trained for the same number of trainer steps
   twice from the same weights, with the same batch (16 prompts × 8 samples, 4
   mini-batches) and learning rate (3e-4, 10 warm-up steps): by GRPO on the task reward
   alone (``rl``), and by GRPO plus the teacher (``distill``: ``distill.teacher`` = the
   checkpoint, ``weight`` 1, the task reward kept, ``distill.estimator`` =
   ``--estimator``). Each is evaluated on the held-out split every ``--eval-every``
   steps.

The figure is, for each student, the first evaluated step whose pass@1 is within 5 points
of the teacher's (``steps_to_teacher_*``; ``null``: not within the budget). The last line
is one JSON object: ``teacher_pass1``, ``target_pass1`` (teacher − 0.05),
``student_pass1_start``, ``steps_to_teacher_rl`` / ``_distill``, ``final_pass1_rl`` /
``_distill``, ``curve_rl`` / ``curve_distill`` (``[step, pass@1]`` pairs),
``kl_distill`` (``[step, exact reverse KL to the teacher]``, nats a completion token,
the mean of ``train/distill_reverse_kl`` over the steps since the last evaluation),
``estimator``, ``steps``, ``eval_problems``, ``eval_samples``, ``distilled_faster`` and
``wall_s``.

What it showed (2 shared CPU cores): NOT the issue's must-show. The teacher (300
warm-start steps, 10 GRPO steps) reaches held-out pass@1 0.580 (the one-digit task holds
out only 9 problems; 32 samples each, up from 16 to halve the sampling noise's
variance); the target is 0.530. Both students start at 0.288. Over 60 steps
(``python benchmarks/distill.py``, 93 s with the teacher reused from ``--work-dir``) the
distilled student (``full``) reads 0.403, 0.337, 0.354, 0.417, 0.437, 0.306 every 10
steps, the RL student 0.354, 0.302, 0.295, 0.323, 0.354, 0.337: neither reaches the
target. Distillation does what it should on the training prompts: the exact reverse KL
to the teacher falls from 0.85 (steps 1-10) to 0.27 nats a token (steps 51-60). With
``--estimator sampled`` (76 s) it falls more slowly, from 0.89 to 0.45, and pass@1 peaks
at 0.382. (``full`` reports the KL averaged over a step's 4 updates, ``sampled`` before
them; both on the batch's own samples.) ``--quick`` (10 steps; 66 s from scratch,
teacher included) is a smoke test: 0.403 (``full``) and 0.354 (RL) at step 10.

Why neither reaches the teacher here: held-out pass@1 on 9 unseen sums measures how a
model generalises from the 80 training sums, which distilling on those prompts does not
transfer. The teacher scores 0.97 on the training sums and 0.63 held out (16 samples,
another seed); a 2×64 student after 300 supervised steps fits the training sums (0.92)
but scores 0.24 held out. Distilled for 100 steps (learning rate 5e-4), the student's
reward on its training batches rises from about 0.5 to 0.7 and its KL falls to 0.2 nats,
while held-out pass@1 goes from 0.40 (step 10) back to 0.22. On the demo's task instead
(one- and two-digit sums, 4×64 teacher after 700 supervised steps: 0.57 on 100 held-out
problems), 2×64 students after 100, 300 and 700 supervised steps start at 0.02, 0.06 and
0.35 (50 problems × 8); in 30-40 steps the ``full`` estimator did not move them (after
300 supervised steps the KL fell from 3.2 to about 2.3 nats in 30 steps), while RL took
the 700-step student to 0.44. The learning rate matters for the KL itself: distilling
alone, the first Adam step at 1e-3 without warm-up raised the exact KL on its own batch
from 1.18 to 2.31 (at 3e-4 it fell to 0.87), which likely explains why earlier runs
without warm-up saw the KL rise; at 3e-3 with warm-up both students degrade (0.20
distilled, 0.08 RL after 30 steps). ``--estimator`` defaults to ``full``, the estimator
that lowers the KL fastest here, though it too does not bring the student to the
teacher.

Usage::

    python benchmarks/distill.py --quick
    python benchmarks/distill.py [--steps 60] [--estimator full|sampled] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from rlaxkit.config.run import RunConfig, small_run_config
from rlaxkit.models import save_hf_checkpoint
from rlaxkit.runtime import Experiment

# Pass@1 within this of the teacher's counts as reaching it (the 5 points).
MARGIN = 0.05
TEACHER = (
    "model.config.hidden_size=64",
    "model.config.intermediate_size=256",
    "model.config.num_layers=4",
    "sft.steps=300",
)
STUDENT = (
    "model.config.hidden_size=64",
    "model.config.intermediate_size=256",
    "sft.steps=100",
    "staleness.max_staleness=0",
    "staleness.batch_size=16",
    "sampling.n=8",
    "trainer.mini_batches=4",
    "optimizer.learning_rate=0.0003",
    "optimizer.warmup_steps=10",
)
DISTILL = ("distill.weight=1.0", "distill.task_reward=true", "batching.equal_rewards=keep")


def pass_at_1(exp: Experiment, problems: int, samples: int) -> float:
    """Held-out pass@1 of the run's current weights."""
    report = exp.evaluate(num_problems=problems, samples=samples)
    return float(next(r["pass@k"] for r in report.rows if r["k"] == 1))


def train_teacher(args: argparse.Namespace, out: Path, cache: Path) -> float:
    """Warm start and GRPO for the teacher; writes its checkpoint to ``out``, returns its
    held-out pass@1. A teacher already in ``out`` is evaluated, not trained again."""
    config = small_run_config(*TEACHER, f"steps={args.teacher_steps}")
    if (out / "config.json").exists():
        config = small_run_config(f"model.checkpoint={out}", "sft.steps=0", "steps=0")
    with Experiment(config, cache_dir=cache) as exp:
        exp.run(config.steps)
        score = pass_at_1(exp, args.eval_problems, args.eval_samples)
        if not (out / "config.json").exists():
            save_hf_checkpoint(exp.current_model(), out, tokenizer=exp.tokenizer)  # type: ignore[arg-type]
    return score


def train_student(
    config: RunConfig, args: argparse.Namespace, cache: Path, target: float
) -> dict[str, Any]:
    """``args.steps`` trainer steps, evaluated every ``args.eval_every``; the curve, the
    first evaluated step at or above ``target`` and, distilling, the exact reverse KL to
    the teacher (``train/distill_reverse_kl``, nats a completion token) averaged over the
    steps since the last evaluation."""
    curve: list[list[float]] = []
    kl: list[list[float]] = []
    since: list[float] = []
    with Experiment(config, cache_dir=cache) as exp:
        curve.append([0, pass_at_1(exp, args.eval_problems, args.eval_samples)])
        for step in range(1, args.steps + 1):
            metrics = exp.step()
            if "train/distill_reverse_kl" in metrics:
                since.append(float(metrics["train/distill_reverse_kl"]))
            if step % args.eval_every == 0:
                curve.append([step, pass_at_1(exp, args.eval_problems, args.eval_samples)])
                if since:
                    kl.append([step, round(sum(since) / len(since), 4)])
                since = []
    reached = next((int(s) for s, p in curve if p >= target), None)
    return {"curve": curve, "kl": kl, "steps_to_teacher": reached, "final_pass1": curve[-1][1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and problems")
    parser.add_argument("--steps", type=int, help="trainer steps of each student")
    parser.add_argument("--teacher-steps", type=int, help="GRPO steps of the teacher")
    parser.add_argument(
        "--estimator",
        choices=("full", "sampled"),
        default="full",
        help="the distilled student's distill.estimator (default full: see the docstring)",
    )
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-problems", type=int, default=9)
    parser.add_argument("--eval-samples", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--work-dir",
        help="where the teacher and warm starts go and are reused (default: temporary)",
    )
    args = parser.parse_args(argv)
    args.steps = args.steps or (10 if args.quick else 60)
    if args.quick:
        args.eval_every = min(args.eval_every, 5)
    args.teacher_steps = args.teacher_steps if args.teacher_steps is not None else 10
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work_dir or scratch)
        cache, teacher_dir = work / "cache", work / "teacher"
        teacher = train_teacher(args, teacher_dir, cache)
        target = teacher - MARGIN
        print(f"teacher: held-out pass@1 {teacher:.3f}; target {target:.3f}")
        base = (*STUDENT, f"seed={args.seed}", f"steps={args.steps}")
        distill = (
            *DISTILL,
            f"distill.teacher={teacher_dir}",
            f"distill.estimator={args.estimator}",
        )
        runs = {"rl": small_run_config(*base), "distill": small_run_config(*base, *distill)}
        results = {name: train_student(c, args, cache, target) for name, c in runs.items()}
    for name, r in results.items():
        curve = " ".join(f"{int(s)}:{p:.3f}" for s, p in r["curve"])
        print(f"{name:>8}: steps to teacher {r['steps_to_teacher']}; pass@1 {curve}")
    kl = " ".join(f"{int(s)}:{v:.3f}" for s, v in results["distill"]["kl"])
    print(f"distill: exact reverse KL to the teacher (nats a token) {kl}")
    rl, distill = results["rl"]["steps_to_teacher"], results["distill"]["steps_to_teacher"]
    report = {
        "quick": args.quick,
        "teacher_pass1": teacher,
        "target_pass1": target,
        "student_pass1_start": results["rl"]["curve"][0][1],
        "steps_to_teacher_rl": rl,
        "steps_to_teacher_distill": distill,
        "final_pass1_rl": results["rl"]["final_pass1"],
        "final_pass1_distill": results["distill"]["final_pass1"],
        "curve_rl": results["rl"]["curve"],
        "curve_distill": results["distill"]["curve"],
        "kl_distill": results["distill"]["kl"],
        "estimator": args.estimator,
        "steps": args.steps,
        "eval_problems": args.eval_problems,
        "eval_samples": args.eval_samples,
        "distilled_faster": distill is not None and (rl is None or distill < rl),
        "wall_s": time.perf_counter() - start,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
