"""Which faults of a plan have fired and what is down, on a fault clock: plain Python
shared by the runtime and the simulator's serial host."""

from __future__ import annotations

from typing import Any

from rlaxkit.rules.fault_plan import Fault, FaultPlan

__all__ = ["FaultState"]


class FaultState:
    """Which faults have fired and what is down or slow, on a fault clock.

    The runtime keeps one (``rlaxkit.runtime.faults``; its clock is logical in
    deterministic mode, ``rounds · runtime.round_s``) and so does the simulator's serial
    host (``sim.entities.host``), so both fire a plan's faults at the same moments and keep the
    same things down.

    Args:
        plan: the faults to inject.
        worker_ids: the fleet's worker names.
        workers_per_slice: workers per slice (``slice-i`` holds ``i·k .. i·k+k-1``).
        restart_s: downtime of a fault without ``restart_after_s``.
        trainer_restart_s: the trainer's, when it differs (default ``restart_s``).
        where: how errors name the plan (``faults`` or ``fault_plan``).

    Raises:
        ValueError: a fault names a worker or slice this fleet does not have.
    """

    def __init__(
        self,
        plan: FaultPlan,
        worker_ids: list[str],
        workers_per_slice: int,
        restart_s: float,
        trainer_restart_s: float | None = None,
        where: str = "faults",
    ):
        self.plan = plan
        self.restart_s = restart_s
        self.trainer_restart_s = restart_s if trainer_restart_s is None else trainer_restart_s
        self.slices: dict[str, list[str]] = {}
        for i, worker in enumerate(worker_ids):
            self.slices.setdefault(f"slice-{i // workers_per_slice}", []).append(worker)
        for index, fault in enumerate(plan):
            at = f"{where}[{index}].target"
            if fault.kind in ("preempt_worker", "slow_worker", "fail_pull") and (
                fault.target is not None and fault.target not in worker_ids
            ):
                raise ValueError(f"{at}: no worker named {fault.target!r}; have {worker_ids}")
            if fault.kind == "preempt_slice" and fault.target not in self.slices:
                raise ValueError(
                    f"{at}: no slice named {fault.target!r}; have {sorted(self.slices)} "
                    "(runtime.workers_per_slice sets how workers group into slices)"
                )
        self.fired: set[int] = set()
        self.worker_down: dict[str, float] = {}  # worker -> back at (fault clock)
        self.slow: dict[str, list[float]] = {}  # worker -> [factor, until, credit]
        self.trainer_down_until: float | None = None

    def downtime(self, fault: Fault) -> float:
        """Clock seconds a preemption keeps its target down."""
        if fault.restart_after_s is not None:
            return fault.restart_after_s
        return self.trainer_restart_s if fault.kind == "preempt_trainer" else self.restart_s

    def preempt_trainer(self, now_s: float, down_s: float) -> bool:
        """The trainer goes down until ``now_s + down_s`` (or later, if it is down until
        then already); returns whether it was up: only then are the steps since its
        checkpoint lost now (a second preemption of a trainer that is down loses none)."""
        was_up = self.trainer_down_until is None
        self.trainer_down_until = max(self.trainer_down_until or 0.0, now_s + down_s)
        return was_up

    @property
    def trainer_down(self) -> bool:
        return self.trainer_down_until is not None

    def _timed(self, now_s: float) -> list[tuple[int, Fault]]:
        """The timed faults whose time has come and that have not fired, with their
        plan indices, in plan time order."""
        due = [
            (i, fault)
            for i, fault in enumerate(self.plan)
            if fault.at_s is not None and fault.at_s <= now_s and i not in self.fired
        ]
        return sorted(due, key=lambda x: (x[1].at_s or 0, x[0]))

    def _at_step(self, step: int) -> list[tuple[int, Fault]]:
        """The faults of ``step`` that have not fired, with their plan indices."""
        return [
            (i, fault)
            for i, fault in enumerate(self.plan)
            if fault.at_step == step and i not in self.fired
        ]

    def _fire(self, due: list[tuple[int, Fault]]) -> list[Fault]:
        self.fired.update(i for i, _ in due)
        return [fault for _, fault in due]

    def due_timed(self, now_s: float) -> list[Fault]:
        """Timed faults whose time has come, marked fired, in plan time order."""
        return self._fire(self._timed(now_s))

    def step_pending(self, step: int) -> bool:
        """Whether a fault of ``step`` has yet to fire (``due_step`` without firing it)."""
        return bool(self._at_step(step))

    def due_step(self, step: int) -> list[Fault]:
        """Step faults for ``step`` not fired yet (each fires once, even if the step is
        reached again after a trainer restore), marked fired."""
        return self._fire(self._at_step(step))

    def targets(self, fault: Fault) -> list[str]:
        """Worker names a worker or slice fault applies to."""
        assert fault.target is not None  # checked when the plan was loaded
        return self.slices[fault.target] if fault.kind == "preempt_slice" else [fault.target]

    def takes_chunk(self, worker_id: str, now_s: float) -> bool:
        """Whether a (possibly slowed) worker decodes a chunk this round."""
        slow = self.slow.get(worker_id)
        if slow is None:
            return True
        factor, until, credit = slow
        if now_s >= until:
            del self.slow[worker_id]
            return True
        credit += 1.0 / factor
        taken = credit >= 1.0
        slow[2] = credit - 1.0 if taken else credit
        return taken

    def quiet(self, now_s: float) -> bool:
        """Nothing is down or slowed and no timed fault is due at ``now_s``: the rounds
        that run while the trainer steps (``runtime.overlap_training``) run only then,
        so that every fault fires and acts between train steps, as in the serial loop."""
        return not (self.waiting() or self.slow or self._timed(now_s))

    def waiting(self) -> bool:
        """True while something is down and scheduled to come back."""
        return bool(self.worker_down) or self.trainer_down_until is not None

    def state_dict(self) -> dict[str, object]:
        return {
            "plan": self.plan.to_dicts(),
            "fired": sorted(self.fired),
            "worker_down": dict(self.worker_down),
            "slow": {w: list(v) for w, v in self.slow.items()},
            "trainer_down_until": self.trainer_down_until,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["plan"] != self.plan.to_dicts():
            raise ValueError(
                "faults: the checkpoint was written with another fault plan "
                f"({len(state['plan'])} faults; this run has {len(self.plan)}); resume "
                "with the same --faults plan or start a new run directory"
            )
        self.fired = set(state["fired"])
        self.worker_down = dict(state["worker_down"])
        self.slow = {w: list(v) for w, v in state["slow"].items()}
        self.trainer_down_until = state["trainer_down_until"]
