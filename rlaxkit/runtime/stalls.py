"""Why a loop cannot yield a batch: the errors a stalled loop, or one that drops group
after group, stops with (the deterministic loop and the concurrent mode's collector)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlaxkit.config.run import RunConfig
    from rlaxkit.runtime.loop import Loop

WARM_START_ADVICE = (
    "with 'filtered', the policy always or never solves the task; warm start longer "
    "(sft.steps), pick an easier task, keep them (batching.equal_rewards=keep), or "
    "with 'stale', raise staleness.max_staleness"
)
MIN_TRAINED_SHARE = 0.01  # of groups; fewer is a run that would drop group after group
# Held-out samples below which pass@1 0 says too little: 0 correct of 16 fits a pass@1 of
# 10%, at which most groups train (the tests' small runs see 0 of 16 and learn).
MIN_EVAL_SAMPLES = 200


class TrainingStalled(RuntimeError):
    """A run that cannot make progress: drop after drop, or a loop with nothing to do.
    The command line turns it into one line and exit status 2."""


def check_start(
    config: RunConfig, pass_at_1: float, eval_samples: int, mean_score: float | None = None
) -> None:
    """Refuses to start RL when the held-out pass@1 ``p`` before it (over
    ``eval_samples`` samples, at least ``MIN_EVAL_SAMPLES``) says almost no group would
    train: with ``batching.equal_rewards=drop`` a group of ``n = sampling.n`` samples
    trains only when its rewards differ, with probability about
    ``1 - p**n - (1 - p)**n`` (independent samples). Under 1% is refused with the
    advice of the drops' error, instead of that error after minutes. A ``mean_score``
    (the held-out mean@1) other than ``p`` is a reward with partial credit, whose groups
    may differ without a correct sample: not refused.

    >>> from rlaxkit.config.run import RunConfig
    >>> check_start(RunConfig(), 0.2, 800)
    >>> check_start(RunConfig(), 0.0, 16)  # too few samples to tell
    >>> check_start(RunConfig(), 0.0, 800, mean_score=0.3)  # partial credit
    >>> check_start(RunConfig(), 0.0, 800)
    Traceback (most recent call last):
    ...
    rlaxkit.runtime.stalls.TrainingStalled: held-out pass@1 before RL is 0.000 ...
    """
    if config.batching.equal_rewards != "drop" or eval_samples < MIN_EVAL_SAMPLES:
        return
    if mean_score is not None and abs(mean_score - pass_at_1) > 1e-9:
        return
    n = config.sampling.n
    trained = 1.0 - pass_at_1**n - (1.0 - pass_at_1) ** n
    if trained >= MIN_TRAINED_SHARE:
        return
    raise TrainingStalled(
        f"held-out pass@1 before RL is {pass_at_1:.3f} ({eval_samples} samples), so about "
        f"{100 * trained:.1f}% of groups of {n} would have rewards that differ and train "
        f"(batching.equal_rewards=drop drops the others as 'filtered'): " + WARM_START_ADVICE
    )


def check_drops(exp: Loop, dropped_before: int) -> None:
    """Raises when more than 50 batches' worth of groups in a row were dropped, saying
    whether the reward is failing (then with its first failure) or the policy."""
    patience = 50 * exp.config.staleness.batch_size
    in_a_row = len(exp.buffer.dropped) - dropped_before
    if in_a_row <= patience:
        return
    failures = exp.reward_failures()
    scored = exp.fleet.reward_counters().get("scored", 0)
    if scored and sum(failures.values()) >= scored / 2:
        raise TrainingStalled(
            f"{in_a_row} prompt groups in a row were dropped and the reward failed on "
            f"{sum(failures.values())} of {scored} samples ({failures}): the reward "
            f"function is failing, not the policy. First failure: "
            f"{exp.books.first_reward_error}. Fix the reward (try it on a few "
            "completions with rlaxkit.tasks.RewardRunner), or raise its timeout"
        )
    reasons = list(exp.buffer.dropped.values())[dropped_before:]
    by_reason = {reason: reasons.count(reason) for reason in sorted(set(reasons))}
    raise TrainingStalled(
        f"{in_a_row} prompt groups in a row were dropped ({by_reason}) without one "
        f"batch: {WARM_START_ADVICE}" + _since_last_step(exp)
    )


def _since_last_step(exp: Loop) -> str:
    """What the drops' error adds when the trainer has stepped: the drops in a row all
    came after its last step, and a policy that solved some problems before an update
    and none after was broken by it (its weights still finite, or ``check_finite``
    would have stopped the run)."""
    if not exp.books.history:
        return ""
    last = exp.books.history[-1]
    figures = ", ".join(
        f"{name} {last[key]:.3g}"
        for name, key in (
            ("pass rate", "reward/pass_rate"),
            ("update norm", "train/update_norm"),
            ("learning rate", "train/learning_rate"),
        )
        if isinstance(last.get(key), int | float)
    )
    return (
        f". Those in a row all came after train step {last['step']} ({figures}): if the "
        "policy solved problems before it and none since, that update broke the policy; "
        "lower optimizer.learning_rate"
    )


def stalled(exp: Loop) -> RuntimeError:
    """The error of a loop that can never yield a batch."""
    return TrainingStalled(
        "the loop stalled: no prompt is in flight and no batch is ready "
        f"(buffer {exp.buffer.counts()}); check staleness.batch_size against "
        "runtime.num_workers * slots_per_worker / sampling.n"
    )
