"""Why a loop cannot yield a batch: the errors a stalled loop, or one that drops group
after group, stops with (the deterministic loop and the concurrent mode's collector)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlaxkit.runtime.loop import Loop


def check_drops(exp: Loop, dropped_before: int) -> None:
    """Raises when more than 50 batches' worth of groups in a row were dropped, saying
    whether the reward is failing (then with its first failure) or the policy."""
    patience = 50 * exp.config.staleness.batch_size
    if len(exp.buffer.dropped) - dropped_before <= patience:
        return
    failures = exp.reward_failures()
    scored = exp.fleet.reward_counters().get("scored", 0)
    if scored and sum(failures.values()) >= scored / 2:
        raise RuntimeError(
            f"{patience} prompt groups in a row were dropped and the reward failed on "
            f"{sum(failures.values())} of {scored} samples ({failures}): the reward "
            f"function is failing, not the policy. First failure: "
            f"{exp.books.first_reward_error}. Fix the reward (try it on a few "
            "completions with rlaxkit.tasks.RewardRunner), or raise its timeout"
        )
    raise RuntimeError(
        f"{patience} prompt groups in a row were dropped "
        f"({exp.buffer.counts()['dropped_by_reason']}) without one batch: with "
        "'filtered', the policy always or never solves the task; warm start longer "
        "(sft.steps), pick an easier task, keep them (batching.equal_rewards=keep), or "
        "with 'stale', raise staleness.max_staleness" + _since_last_step(exp)
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
    return RuntimeError(
        "the loop stalled: no prompt is in flight and no batch is ready "
        f"(buffer {exp.buffer.counts()}); check staleness.batch_size against "
        "runtime.num_workers * slots_per_worker / sampling.n"
    )
