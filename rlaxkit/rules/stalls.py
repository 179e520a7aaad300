"""Why a loop cannot yield a batch: the errors a stalled loop, or one that drops group
after group, stops with. Pure functions of what the loop counts (the deterministic
loop, the concurrent mode's collector and the agent endpoint's collector call them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
    equal_rewards: str,
    n: int,
    pass_at_1: float,
    eval_samples: int,
    mean_score: float | None = None,
) -> None:
    """Refuses to start RL when the held-out pass@1 ``p`` before it (over
    ``eval_samples`` samples, at least ``MIN_EVAL_SAMPLES``) says almost no group would
    train: with ``batching.equal_rewards=drop`` a group of ``n = sampling.n`` samples
    trains only when its rewards differ, with probability about
    ``1 - p**n - (1 - p)**n`` (independent samples). Under 1% is refused with the
    advice of the drops' error, instead of that error after minutes. A ``mean_score``
    (the held-out mean@1) other than ``p`` is a reward with partial credit, whose groups
    may differ without a correct sample: not refused.

    >>> check_start("drop", 8, 0.2, 800)
    >>> check_start("drop", 8, 0.0, 16)  # too few samples to tell
    >>> check_start("drop", 8, 0.0, 800, mean_score=0.3)  # partial credit
    >>> check_start("keep", 8, 0.0, 800)  # groups of equal rewards train
    >>> check_start("drop", 8, 0.0, 800)
    Traceback (most recent call last):
    ...
    rlaxkit.rules.stalls.TrainingStalled: held-out pass@1 before RL is 0.000 ...
    """
    if equal_rewards != "drop" or eval_samples < MIN_EVAL_SAMPLES:
        return
    if mean_score is not None and abs(mean_score - pass_at_1) > 1e-9:
        return
    trained = 1.0 - pass_at_1**n - (1.0 - pass_at_1) ** n
    if trained >= MIN_TRAINED_SHARE:
        return
    raise TrainingStalled(
        f"held-out pass@1 before RL is {pass_at_1:.3f} ({eval_samples} samples), so about "
        f"{100 * trained:.1f}% of groups of {n} would have rewards that differ and train "
        f"(batching.equal_rewards=drop drops the others as 'filtered'): " + WARM_START_ADVICE
    )


def drop_patience(batch_size: int) -> int:
    """How many groups in a row may be dropped before a run is called stalled: 50
    batches' worth."""
    return 50 * batch_size


def drops_error(
    reasons: Sequence[str],
    *,
    failures: Mapping[str, int],
    scored: int,
    first_reward_error: str | None,
    last_step: Mapping[str, object] | None,
) -> TrainingStalled:
    """The error of a run that dropped the groups ``reasons`` names in a row (more than
    ``drop_patience``), saying whether the reward is failing (then with its first
    failure: ``failures`` of ``scored`` samples) or the policy; ``last_step`` is the
    metrics of the trainer's last step, if it took one.

    >>> str(drops_error(["stale", "filtered", "filtered"], failures={}, scored=6,
    ...                 first_reward_error=None, last_step=None))[:67]
    "3 prompt groups in a row were dropped ({'filtered': 2, 'stale': 1})"
    """
    in_a_row = len(reasons)
    if scored and sum(failures.values()) >= scored / 2:
        return TrainingStalled(
            f"{in_a_row} prompt groups in a row were dropped and the reward failed on "
            f"{sum(failures.values())} of {scored} samples ({dict(failures)}): the reward "
            f"function is failing, not the policy. First failure: "
            f"{first_reward_error}. Fix the reward (try it on a few "
            "completions with rlaxkit.tasks.RewardRunner), or raise its timeout"
        )
    by_reason = {reason: reasons.count(reason) for reason in sorted(set(reasons))}
    return TrainingStalled(
        f"{in_a_row} prompt groups in a row were dropped ({by_reason}) without one "
        f"batch: {WARM_START_ADVICE}" + _since_last_step(last_step)
    )


def _since_last_step(last: Mapping[str, object] | None) -> str:
    """What the drops' error adds when the trainer has stepped: the drops in a row all
    came after its last step, and a policy that solved some problems before an update
    and none after was broken by it (its weights still finite, or ``check_finite``
    would have stopped the run)."""
    if not last:
        return ""
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


def stall_error(buffer_counts: Mapping[str, int]) -> TrainingStalled:
    """The error of a loop that can never yield a batch (its buffer's counts)."""
    return TrainingStalled(
        "the loop stalled: no prompt is in flight and no batch is ready "
        f"(buffer {dict(buffer_counts)}); check staleness.batch_size against "
        "runtime.num_workers * slots_per_worker / sampling.n"
    )
