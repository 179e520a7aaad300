"""Applies a FaultPlan (``rlaxkit.rules.fault_plan``) to the simulated entities.

Timed faults fire from one process in ``at_s`` order; step-indexed faults fire right
after the trainer first reaches ``at_step`` (from their own zero-delay process, so a
trainer preemption is never the trainer interrupting itself). Random preemptions of a
:class:`~sim.specs.PreemptionSpec` are generated as a plan first, so a simulated run and
a runtime run can replay the very same faults.

On the serial host (:mod:`sim.entities.host`) the plan is kept by the runtime's own
``rlaxkit.rules.fault_clock.FaultState`` instead: faults fire on the logical clock ``rounds ·
host.round_s``, timed ones before the first round at or after their ``at_s``, step ones
after that step's compute and before its push or save, as the deterministic local
runtime fires them.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from simpy.events import ProcessGenerator

from rlaxkit.rules.fault_clock import FaultState
from rlaxkit.rules.fault_plan import Fault, FaultPlan, random_preemptions

if TYPE_CHECKING:
    from sim.entities.context import SimContext, WorkerView
    from sim.scenario import Scenario

__all__ = ["FaultInjector", "plan_for"]


def plan_for(scenario: Scenario) -> FaultPlan:
    """The scenario's explicit faults plus its random preemptions over the horizon."""
    spec = scenario.preemptions
    plans = [scenario.fault_plan]
    preemptions = functools.partial(
        random_preemptions,
        horizon_s=scenario.horizon_s,
        distribution=spec.distribution,
        weibull_shape=spec.weibull_shape,
        seed=scenario.seed,
    )
    fleet = scenario.fleet
    if spec.worker_mtbf_s is not None:
        workers = [f"worker-{i}" for i in range(fleet.num_workers)]
        plans.append(preemptions(targets=workers, mtbf_s=spec.worker_mtbf_s))
    if spec.slice_mtbf_s is not None:
        slices = [f"slice-{i}" for i in range(fleet.num_slices)]
        plans.append(preemptions(targets=slices, mtbf_s=spec.slice_mtbf_s, kind="preempt_slice"))
    if spec.trainer_mtbf_s is not None:
        plans.append(
            preemptions(targets=["trainer"], mtbf_s=spec.trainer_mtbf_s, kind="preempt_trainer")
        )
    return plans[0].merged(*plans[1:])


class FaultInjector:
    """Fires the faults of a plan at their times or steps."""

    name = "injector"

    def __init__(self, sim: SimContext, plan: FaultPlan) -> None:
        self.sim = sim
        self.env = sim.env
        self._by_step: dict[int, list[Fault]] = {}
        if sim.host is not None:  # one thread: the host fires them between its rounds
            if len(plan):
                fleet = sim.scenario.fleet
                sim.host.faults = FaultState(
                    plan,
                    sim.host.worker_names,
                    fleet.workers_per_slice,
                    fleet.restart_s,
                    trainer_restart_s=sim.scenario.trainer.restart_s,
                    where="fault_plan",
                )
            return
        self.workers = {worker.name: worker for worker in sim.workers}
        self.slices: dict[str, list[WorkerView]] = {}
        for worker in sim.workers:
            self.slices.setdefault(worker.slice_name, []).append(worker)
        for index, fault in enumerate(plan):
            self._check_target(fault, f"fault_plan[{index}]")
        self._by_step = plan.by_step()
        timed = plan.timed()
        if timed:
            self.env.process(self._fire_timed(timed))

    def _check_target(self, fault: Fault, where: str) -> None:
        kind, target = fault.kind, fault.target
        if kind in ("preempt_worker", "slow_worker") and target not in self.workers:
            raise ValueError(f"{where}.target: no worker named {target!r} in this fleet")
        if kind == "fail_pull" and target is not None and target not in self.workers:
            raise ValueError(f"{where}.target: no worker named {target!r} in this fleet")
        if kind == "preempt_slice" and target not in self.slices:
            raise ValueError(f"{where}.target: no slice named {target!r} in this fleet")

    def _fire_timed(self, faults: list[Fault]) -> ProcessGenerator:
        for fault in faults:
            at_s = fault.at_s
            assert at_s is not None  # FaultPlan.timed() gives only faults with at_s
            if at_s > self.env.now:
                yield self.env.timeout(at_s - self.env.now)
            self.apply(fault)

    def on_step(self, step: int) -> None:
        """Called by the trainer after each step; fires that step's faults once."""
        faults = self._by_step.pop(step, None)
        if faults:
            self.env.process(self._fire_now(faults))

    def _fire_now(self, faults: list[Fault]) -> ProcessGenerator:
        yield self.env.timeout(0)
        for fault in faults:
            self.apply(fault)

    def apply(self, fault: Fault) -> None:
        """Apply one fault to the entity it names."""
        sim = self.sim
        scenario = sim.scenario
        kind = fault.kind
        if kind == "preempt_worker":
            down = _or(fault.restart_after_s, scenario.fleet.restart_s)
            self.workers[_target(fault)].preempt(down)
        elif kind == "preempt_slice":
            down = _or(fault.restart_after_s, scenario.fleet.restart_s)
            sim.counters.preemptions["slice"] += 1
            for worker in self.slices[_target(fault)]:
                worker.preempt(down)
        elif kind == "preempt_trainer":
            sim.trainer.preempt(_or(fault.restart_after_s, scenario.trainer.restart_s))
        elif kind == "kill_param_server":
            sim.record(sim.ps.name, "fault", sim.ps.latest, fault=kind)
            sim.ps.kill(_or(fault.restart_after_s, scenario.param_server.restart_s))
        elif kind == "slow_worker":
            target, factor, duration_s = _target(fault), fault.factor, fault.duration_s
            if factor is None or duration_s is None:
                raise ValueError(f"{target}: a slow_worker fault needs factor and duration_s")
            sim.record(target, "fault", None, fault=kind, factor=factor)
            self.workers[target].slow(factor, duration_s)
        elif kind == "fail_pull":
            sim.ps.failing_pulls[fault.target or "*"] += fault.count
        elif kind == "hang_reward":
            sim.verifier.hangs_pending += fault.count


def _target(fault: Fault) -> str:
    """The actor a fault names; the kinds that call this require one."""
    if fault.target is None:
        raise ValueError(f"a {fault.kind} fault needs a target")
    return fault.target


def _or(value: float | None, default: float) -> float:
    return default if value is None else value
