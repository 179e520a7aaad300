"""Wires the entities of one scenario into a SimPy environment and runs it.

>>> from sim.presets import toy
>>> result = simulate(toy(target_steps=3))
>>> result.steps
3
"""

from __future__ import annotations

import time

import simpy

from rlaxkit.rules.audit import AuditBook
from rlaxkit.rules.policies import policy_to_dict
from rlaxkit.rules.trace import TraceSink
from sim.entities.buffer import SimBuffer
from sim.entities.draws import WorkloadDraws
from sim.entities.groups import Group, SimSample
from sim.entities.host import SerialHost
from sim.entities.injector import FaultInjector, plan_for
from sim.entities.param_server import SimParameterServer
from sim.entities.trainer import Trainer
from sim.entities.verifier import VerifierPool
from sim.entities.worker import SimWorker
from sim.metrics import Counters, SimResult, build_result
from sim.scenario import Scenario

__all__ = ["Simulation", "simulate"]


def events_scheduled(env: simpy.Environment) -> int:
    """Events scheduled so far in ``env``.

    SimPy numbers every scheduled event from one counter (``Environment._eid``); reading
    it costs nothing per event, unlike overriding ``schedule``. Pinned by simpy<5.
    """
    return next(env._eid)


class Simulation:
    """One run of a scenario: the environment, the entities, counters and trace.

    Args:
        scenario: What to simulate.
        trace: Where to write trace events (``rlaxkit.rules.trace`` schema), or ``None`` to
            keep only counters (much faster for fleet-scale runs).
    """

    def __init__(self, scenario: Scenario, *, trace: TraceSink | None = None) -> None:
        self.scenario = scenario
        self.trace = trace
        self.env = simpy.Environment()
        self.counters = Counters()
        self.host_active = 0
        self.draws = WorkloadDraws(scenario)
        self.audit = AuditBook()  # sampled against trained (``SimResult.audit``)
        self.record("trainer", "run_start", 0, config=run_config(scenario))
        self.ps = SimParameterServer(self)
        self.buffer = SimBuffer(self)
        self.verifier = VerifierPool(self)
        # A serial host (the deterministic local runtime) runs the workers' chunks in the
        # trainer's thread; otherwise every worker slot is a process of its own.
        self.host = SerialHost(self) if scenario.host.serial else None
        self.workers = (
            []
            if self.host is not None
            else [SimWorker(self, i) for i in range(scenario.fleet.num_workers)]
        )
        self.trainer = Trainer(self)
        self.injector = FaultInjector(self, plan_for(scenario))

    def record(self, actor: str, kind: str, version: int | None, **fields: object) -> None:
        """Write one trace event at the current simulated time (no-op without a trace)."""
        if self.trace is not None:
            self.trace.record(self.env.now, kind, actor, version, **fields)

    def record_start(
        self, actor: str, version: int | None, sample: SimSample, occupancy: int
    ) -> None:
        """The ``generation_start`` event of ``sample`` (no-op without a trace)."""
        if self.trace is None:
            return
        self.record(
            actor,
            "generation_start",
            version,
            sample=sample.sample_id,
            rollout=str(sample.group.group_id),
            prompt_tokens=sample.prompt_tokens,
            occupancy=occupancy,
        )

    def record_end(
        self, actor: str, version: int | None, sample: SimSample, first_version: int
    ) -> None:
        """The ``generation_end`` event of ``sample`` (no-op without a trace)."""
        if self.trace is None:
            return
        extra = (
            {"turn_tokens": list(sample.turn_tokens)} if self.scenario.workload.multi_turn else {}
        )
        self.record(
            actor,
            "generation_end",
            version,
            sample=sample.sample_id,
            rollout=str(sample.group.group_id),
            tokens=sample.tokens,
            first_version=first_version,
            finish="length" if sample.truncated else "stop",
            **extra,
        )

    def record_tool_call(
        self, actor: str, version: int | None, sample: SimSample, turn: int, *, released: bool
    ) -> None:
        """The ``tool_call`` event of ``sample``'s call after policy turn ``turn``, at
        its end (no-op without a trace)."""
        if self.trace is None:
            return
        self.record(
            actor,
            "tool_call",
            version,
            sample=sample.sample_id,
            rollout=str(sample.group.group_id),
            turn=turn,
            duration_s=sample.tool_s[turn],
            outcome="ok",
            observation_tokens=sample.observations[turn],
            action_tokens=sample.turn_tokens[turn],
            released=released,
        )

    def new_group(self) -> Group:
        """A new prompt group with lengths drawn from the workload distributions."""
        return self.draws.new_group()

    def run(self) -> SimResult:
        """Run until the target step or the horizon, and summarise."""
        env = self.env
        horizon = env.timeout(self.scenario.horizon_s)
        wall_start = time.perf_counter()
        env.run(until=env.any_of([self.trainer.done, horizon]))
        wall_s = time.perf_counter() - wall_start
        fleet = self.scenario.fleet
        return build_result(
            name=self.scenario.name,
            counters=self.counters,
            sim_time_s=env.now,
            total_slots=fleet.num_workers * fleet.slots_per_worker,
            events=events_scheduled(env),
            wall_s=wall_s,
            reached_target=self.trainer.done.triggered,
            audit=self.audit.audit(self.buffer.ledger.dropped),
        )


def run_config(scenario: Scenario) -> dict[str, object]:
    """The configuration a trace's ``run_start`` event carries (policies, fleet shape).

    The runtime writes the same keys so :func:`sim.calibration.calibrate.calibrate` can rebuild the
    run from either trace.
    """
    fleet = scenario.fleet
    return {
        "staleness": policy_to_dict(scenario.staleness),
        "weight_sync": policy_to_dict(scenario.weight_sync),
        "checkpoint": policy_to_dict(scenario.checkpointing),
        "batching": policy_to_dict(scenario.batching),
        "recovery": policy_to_dict(scenario.recovery),
        "num_workers": fleet.num_workers,
        "slots_per_worker": fleet.slots_per_worker,
        "group_size": scenario.workload.group_size,
        "prompts_per_step": scenario.workload.prompts_per_step,
        "max_response_tokens": scenario.workload.max_response_tokens,
        "occupancy_scope": fleet.occupancy_scope,
        "release_after_s": fleet.release_after_s,
        "weight_bytes": scenario.param_server.weight_bytes,
        "trainer_chips": scenario.trainer.chips,
        "trainer_pauses_fleet": scenario.trainer.pauses_fleet,
        "host_executor": scenario.host.executor,
        "host_concurrent_chunks": scenario.host.concurrent_chunks,
        "host_threaded_chunks": scenario.host.threaded_chunks,
        "chunk_steps": scenario.host.chunk_steps,
        "target_steps": scenario.target_steps,
    }


def simulate(scenario: Scenario, *, trace: TraceSink | None = None) -> SimResult:
    """Simulate ``scenario`` and return its :class:`~sim.metrics.SimResult`."""
    return Simulation(scenario, trace=trace).run()
