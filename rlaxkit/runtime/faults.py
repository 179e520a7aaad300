"""Fault injection: a ``FaultPlan`` fired on the run's fault clock, on every placement.

Faults are wrappers applied only when a plan is given: without one the driver holds
``NO_FAULTS``, whose every method is a no-op. With one, ``FaultInjector`` fires the due
faults through the placement's parts (the fleet, the trainer client, the store) and
keeps what is down. The plan format is the simulator's (``rlaxkit.rules.fault_plan``); what each
fault does:

- ``preempt_worker`` / ``preempt_slice``: the worker(s) lose their engine, weights and
  in-flight prompts; the prompts go back to the controller and are re-issued with the
  same ids and seeds; after the downtime the worker restarts empty and pulls the newest
  weights before it takes work.
- ``preempt_trainer``: the trainer's progress since its last checkpoint is lost; after
  the downtime it restores that checkpoint from disk, the parameter server starts a new
  lineage at the restored version, and the workers go on (those holding weights of the
  discarded branch drop them and re-issue their prompts).
- ``kill_param_server``: the store is unreachable for the downtime: pulls fail (counted,
  retried next round), a push waits and is published when it is back.
- ``slow_worker``: the worker decodes one chunk every ``factor`` rounds.
- ``fail_pull``: the next ``count`` pulls of ``target`` (any worker when unset) fail.
- ``hang_reward``: the next ``count`` reward calls hang until the reward timeout.

On Ray a preemption is real: the worker's or the trainer's actor is killed (the fleet
starts a new worker actor after the downtime; Ray restarts the trainer, which restores
the checkpoint), and ``kill_param_server`` kills the parameter-server actor, which Ray
restarts empty and the trainer publishes to again. The kinds that reach inside a
worker's process (``fail_pull``, ``hang_reward``) are injected by the local placement
only; a plan with them is refused on Ray before anything starts.

The fault clock (``FaultTarget.fault_now``) is logical in deterministic mode: ``rounds ·
runtime.round_s``. A timed fault fires at the start of the first round at or after its
``at_s``; a step fault right after the trainer finishes that step, before it pushes or
saves (as in the simulator, a trainer preempted after step ``s`` loses step ``s``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlaxkit.rules.fault_clock import FaultState
from rlaxkit.rules.fault_plan import Fault, FaultPlan
from rlaxkit.runtime.faulty_store import UnreliableParameterServer

if TYPE_CHECKING:
    from pathlib import Path

    from rlaxkit.config.run import RunConfig
    from rlaxkit.runtime.parts import FaultTarget


__all__ = [
    "NO_FAULTS",
    "FaultInjector",
    "FaultState",
    "load_plan",
]


def load_plan(plan: FaultPlan | str | os.PathLike | list | None) -> FaultPlan:
    """A plan given as a ``FaultPlan``, a path to YAML/JSON, a list of fault mappings,
    or ``None`` (no faults)."""
    if plan is None:
        return FaultPlan()
    if isinstance(plan, FaultPlan):
        return plan
    if isinstance(plan, list | tuple):
        return FaultPlan.from_dicts(plan)
    return FaultPlan.load(plan)


# The summary's preemption counters, by the fault kind that counts in each.
PREEMPTION_KINDS = {
    "preempt_worker": "worker",
    "preempt_slice": "slice",
    "preempt_trainer": "trainer",
    "kill_param_server": "param_server",
}

# Kinds a Ray placement injects; the others reach inside a worker's process.
RAY_KINDS = (*PREEMPTION_KINDS, "slow_worker")


# Headroom of ``plausible_end_s`` over one worker generating every batch at full length:
# groups dropped as stale or rolled back are generated again.
END_HEADROOM = 4


def plausible_end_s(plan: FaultPlan, config: RunConfig) -> float:
    """An upper bound on the fault clock at which the run ends: ``END_HEADROOM`` times the
    rounds one worker alone needs to generate every step's batch, every row at the
    longest generation (``sampling.max_new_tokens`` or ``episodes.max_episode_tokens``)
    one chunk a round plus one round to start, times ``runtime.round_s``, plus every
    downtime of the plan.

    >>> from rlaxkit.config.run import small_run_config
    >>> plausible_end_s(FaultPlan(), small_run_config("steps=2", "runtime.chunk_steps=4"))
    520.0
    """
    runtime = config.runtime
    rows = config.staleness.batch_size * config.group_size
    longest = max(config.sampling.max_new_tokens, config.episodes.max_episode_tokens)
    rounds = -(-rows // runtime.slots_per_worker) * (-(-longest // runtime.chunk_steps) + 1)
    downtime = 0.0
    for fault in plan:
        if fault.kind in PREEMPTION_KINDS:
            restart_s = fault.restart_after_s
            downtime += runtime.restart_s if restart_s is None else restart_s
        elif fault.kind == "slow_worker" and fault.duration_s is not None and fault.factor:
            downtime += fault.duration_s * fault.factor
    return END_HEADROOM * config.steps * rounds * runtime.round_s + downtime


def check_plan_bounds(plan: FaultPlan, config: RunConfig) -> None:
    """Refuses a fault that can never fire in this run, naming it and the bound: a step
    outside ``1..steps`` (a step fault fires right after the trainer takes that step) or
    a time past ``plausible_end_s``. (A worker or slice the fleet lacks is refused by
    ``FaultState``.)"""
    end_s = None
    for index, fault in enumerate(plan):
        where = f"faults[{index}] ({fault.kind})"
        if fault.at_step is not None and not 1 <= fault.at_step <= config.steps:
            raise ValueError(
                f"{where}.at_step: {fault.at_step} is outside this run's steps 1..{config.steps}"
                " (a step fault fires right after the trainer takes that step, so it would"
                f" never fire); use a step in 1..{config.steps} or raise steps"
            )
        if fault.at_s is not None:
            end_s = plausible_end_s(plan, config) if end_s is None else end_s
            if fault.at_s > end_s:
                raise ValueError(
                    f"{where}.at_s: {fault.at_s:g} s is past any plausible end of this run"
                    f" ({end_s:g} s on the fault clock: {END_HEADROOM}x the rounds one worker"
                    " needs for every batch at full length, times runtime.round_s, plus the"
                    " plan's downtimes), so it would never fire; use an earlier at_s or an"
                    " at_step"
                )


def check_plan_supported(plan: FaultPlan, config: RunConfig, run_dir: Path | None) -> None:
    """Refuses, naming the fix, a plan the placement cannot inject.

    Raises:
        ValueError: a plan in concurrent mode, a kind Ray does not inject, a
            ``preempt_trainer`` fault without a ``run_dir`` to checkpoint to, or a fault
            that can never fire (``check_plan_bounds``).
    """
    if not len(plan):
        return
    if config.runtime.mode == "concurrent":
        raise ValueError(
            "faults: fault injection replays on the deterministic loop's logical clock; "
            "runtime.mode=concurrent does not support it (use runtime.mode=deterministic)"
        )
    if config.runtime.backend == "ray":
        for index, fault in enumerate(plan):
            if fault.kind == "preempt_trainer" and config.ray.weight_store != "object_store":
                raise ValueError(
                    f"faults[{index}]: preempt_trainer on ray rolls the parameter server "
                    "back to the checkpoint, which the tensorstore weight store cannot do; "
                    "use ray.weight_store=object_store"
                )
            if fault.kind not in RAY_KINDS:
                raise ValueError(
                    f"faults[{index}].kind: {fault.kind!r} reaches inside a worker's process "
                    f"and is injected by runtime.backend=local only; on ray use {RAY_KINDS}"
                )
    check_plan_bounds(plan, config)
    if run_dir is None and any(f.kind == "preempt_trainer" for f in plan):
        raise ValueError(
            "faults: preempt_trainer restores the last checkpoint; give the Experiment "
            "a run_dir to write checkpoints to"
        )


class NoFaults:
    """The driver's fault hooks when no plan is given: nothing fires, nothing is down."""

    def before_round(self, exp: FaultTarget, now_s: float) -> None:
        pass

    def live(self, worker_ids: list[str]) -> list[str]:
        return worker_ids

    def chunked(self, worker_ids: list[str], now_s: float) -> list[str]:
        return worker_ids

    def due_step(self, step: int) -> list[Fault]:
        return []

    def apply(self, exp: FaultTarget, fault: Fault) -> None:
        raise AssertionError("no fault plan")

    def trainer_down(self) -> bool:
        return False

    def restore_trainer_if_due(self, exp: FaultTarget) -> None:
        pass

    def waiting(self) -> bool:
        return False

    def quiet(self, now_s: float) -> bool:
        """Nothing is down and nothing is due (``FaultState.quiet``)."""
        return True

    def store_down(self) -> bool:
        """True while an injected parameter-server outage holds pushes back."""
        return False

    def held_weights(self) -> dict[int, Any]:
        return {}

    def report(self, now_s: float, step: int) -> dict[str, list[dict[str, Any]]]:
        """The plan's faults that fired and those that did not, with why (``FaultInjector``)."""
        return {"fired": [], "not_fired": []}

    def state_dict(self) -> dict[str, Any]:
        return {"plan": []}

    def load_state_dict(self, state: dict[str, Any], weights_for: Callable[[int], Any]) -> None:
        pass


NO_FAULTS = NoFaults()


class FaultInjector(NoFaults):
    """Fires a plan's faults through the driver's parts and keeps what is down.

    Args:
        state: which faults fired, what is down or slow (``FaultState``).
        store: the placement's faulty store (local: an ``UnreliableParameterServer``;
            ``None`` where outages are real, on Ray).
    """

    def __init__(self, state: FaultState, store: UnreliableParameterServer | None = None):
        self.state = state
        self.store = store

    @staticmethod
    def for_plan(plan: FaultPlan, config: RunConfig, run_dir: Path | None) -> NoFaults:
        """``NO_FAULTS`` for an empty plan, else an injector (its store is set by the
        placement); ``check_plan_supported`` first."""
        check_plan_supported(plan, config, run_dir)
        if not len(plan):
            return NO_FAULTS
        runtime = config.runtime
        worker_ids = [f"worker-{i}" for i in range(runtime.num_workers)]
        return FaultInjector(
            FaultState(plan, worker_ids, runtime.workers_per_slice, runtime.restart_s)
        )

    # -- the round -------------------------------------------------------------------
    def before_round(self, exp: FaultTarget, now_s: float) -> None:
        """Fires due timed faults, then brings back what is due."""
        for fault in self.state.due_timed(now_s):
            self.apply(exp, fault)
        for worker_id, until in sorted(self.state.worker_down.items()):
            if now_s >= until:
                del self.state.worker_down[worker_id]
                exp.fleet.restart(worker_id)
                exp.trace.record(exp.clock(), "restart", worker_id, None)
        if self.store is not None and self.store.tick(now_s):
            exp.trace.record(exp.clock(), "restart", "param_server", self.store.latest_version())

    def live(self, worker_ids: list[str]) -> list[str]:
        return [w for w in worker_ids if w not in self.state.worker_down]

    def chunked(self, worker_ids: list[str], now_s: float) -> list[str]:
        return [w for w in worker_ids if self.state.takes_chunk(w, now_s)]

    def due_step(self, step: int) -> list[Fault]:
        return self.state.due_step(step)

    def trainer_down(self) -> bool:
        return self.state.trainer_down_until is not None

    def waiting(self) -> bool:
        return self.state.waiting() or self.store_down()

    def quiet(self, now_s: float) -> bool:
        return self.state.quiet(now_s) and not self.store_down()

    def store_down(self) -> bool:
        return self.store is not None and self.store.down_until is not None

    # -- firing ----------------------------------------------------------------------
    def apply(self, exp: FaultTarget, fault: Fault) -> None:
        """Injects one fault (see the module docstring)."""
        now, down = exp.fault_now(), self.state.downtime(fault)
        if fault.kind in PREEMPTION_KINDS:
            exp.books.preemptions[PREEMPTION_KINDS[fault.kind]] += 1
        if fault.kind in ("preempt_worker", "preempt_slice"):
            for worker_id in self.state.targets(fault):
                self.preempt_worker(exp, worker_id, down)
            return
        if fault.kind == "preempt_trainer":
            was_up = self.state.preempt_trainer(now, down)
            lost = exp.version - exp.books.last_save_step if was_up else 0
            exp.trace.record(exp.clock(), "preemption", "trainer", exp.version, lost_steps=lost)
            if was_up:
                exp.trainer.kill()
            return
        actor = {"kill_param_server": "param_server", "hang_reward": "verifier"}
        exp.trace.record(
            exp.clock(),
            "fault",
            fault.target or actor.get(fault.kind, "controller"),
            None,
            fault=fault.kind,
            logical_s=now,
        )
        if fault.kind == "kill_param_server":
            if self.store is not None:
                self.store.kill(now + down)
            else:
                exp.parts.kill_store()
        elif fault.kind == "slow_worker":
            # FaultPlan requires all three of a slow_worker fault.
            assert fault.target and fault.factor and fault.duration_s is not None
            self.state.slow[fault.target] = [fault.factor, now + fault.duration_s, 0.0]
        elif fault.kind == "fail_pull":
            assert self.store is not None  # refused on Ray before the run starts
            self.store.failing[fault.target or "*"] += fault.count
        elif fault.kind == "hang_reward":
            exp.parts.scorer.inject_hang(fault.count)

    def preempt_worker(self, exp: FaultTarget, worker_id: str, down_s: float) -> None:
        """Takes a worker down for ``down_s`` fault-clock seconds; its in-flight prompts
        are re-issued (same ids and seeds) to whichever worker has room."""
        self.state.worker_down[worker_id] = exp.fault_now() + down_s
        exp.lose_worker(worker_id, exp.fleet.preempt(worker_id), down_s=down_s)

    def restore_trainer_if_due(self, exp: FaultTarget) -> None:
        """After its downtime the trainer restores its last checkpoint: the steps since
        are lost, their groups go back to the buffer's ready queue, the store starts a
        new lineage at the restored version, and workers holding weights of the
        discarded branch drop them and re-issue their prompts."""
        until = self.state.trainer_down_until
        if until is None or exp.fault_now() < until:
            return
        exp.trace.record(exp.clock(), "restart", "trainer", exp.version)
        restored = exp.trainer.restore(exp.books.last_save_step)
        self.state.trainer_down_until = None
        exp.roll_back(restored)
        exp.note_published(exp.trainer.publish(restored, reset=True))

    def report(self, now_s: float, step: int) -> dict[str, list[dict[str, Any]]]:
        """The plan's faults that fired and those that did not, each as its plan entry
        with its ``index`` and, for one that did not, ``why``: the run stopped (at step
        ``step``, at ``now_s`` on the fault clock) before its step or time came."""
        fired: list[dict[str, Any]] = []
        not_fired: list[dict[str, Any]] = []
        for index, fault in enumerate(self.state.plan):
            entry = {"index": index, **fault.to_dict()}
            if index in self.state.fired:
                fired.append(entry)
            elif fault.at_step is not None:
                why = f"the run stopped at step {step}, before step {fault.at_step}"
                not_fired.append(entry | {"why": why})
            else:
                why = f"the run stopped at {now_s:g} s on the fault clock, before {fault.at_s:g} s"
                not_fired.append(entry | {"why": why})
        return {"fired": fired, "not_fired": not_fired}

    # -- checkpoints -----------------------------------------------------------------
    def held_weights(self) -> dict[int, Any]:
        """A push held back by a parameter-server outage (a checkpoint keeps it)."""
        return {} if self.store is None else self.store.held_weights()

    def state_dict(self) -> dict[str, Any]:
        out = self.state.state_dict()
        if self.store is not None:
            out["param_server"] = self.store.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any], weights_for: Callable[[int], Any]) -> None:
        """Loads :meth:`state_dict`'s items; ``weights_for(version)`` gives the host
        weights of a version the checkpoint holds (a push an outage held back)."""
        self.state.load_state_dict({k: v for k, v in state.items() if k != "param_server"})
        if self.store is not None:
            self.store.load_state_dict(state["param_server"], weights_for)
