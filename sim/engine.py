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
from sim.distributions import CorrelatedLengths, Stream, Uniform
from sim.entities.buffer import SimBuffer
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
        workload = scenario.workload
        self._prompt_lengths = Stream(workload.prompt_tokens, seed=scenario.seed, name="prompts")
        self._response_lengths = Stream(
            workload.response_tokens, seed=scenario.seed, name="responses"
        )
        # Multi-turn draws have streams of their own, so single-turn runs keep every
        # other draw (and their exact event logs) unchanged.
        self._multi_turn = workload.multi_turn
        self._turns = Stream(workload.turns, seed=scenario.seed, name="turns")
        self._tool_s = Stream(workload.tool_latency_s, seed=scenario.seed, name="tool_latency")
        self._observations = Stream(
            workload.observation_tokens, seed=scenario.seed, name="observations"
        )
        # A group's lengths coupled by a Gaussian copula (WorkloadSpec.length_correlation):
        # made only when set, so runs without it keep every draw (and their event logs).
        rho = workload.length_correlation
        self._lengths = (
            None
            if rho is None or self._multi_turn
            else CorrelatedLengths(workload.response_tokens, rho, seed=scenario.seed)
        )
        # The audit's draws have streams of their own too (every other draw unchanged).
        self._pass_rates = Stream(workload.pass_rate, seed=scenario.seed, name="pass_rate")
        self._outcomes = Stream(Uniform(low=0.0, high=1.0), seed=scenario.seed, name="correct")
        self.audit = AuditBook()  # sampled against trained (``SimResult.audit``)
        self._next_group = 0
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
        extra = {"turn_tokens": list(sample.turn_tokens)} if self._multi_turn else {}
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
        workload = self.scenario.workload
        group = Group(self._next_group)
        self._next_group += 1
        prompt_tokens = max(0, round(self._prompt_lengths.next()))
        cap = workload.max_response_tokens
        draw = self._response_lengths.next
        pass_rate = min(1.0, max(0.0, self._pass_rates.next()))
        scale = 1.0 + (workload.hard_length_factor - 1.0) * (1.0 - pass_rate)
        if self._lengths is not None:
            draw = iter(self._lengths.group(workload.group_size)).__next__
        for index in range(workload.group_size):
            correct = self._outcomes.next() < pass_rate
            if self._multi_turn:
                sample = self._episode(group, index, prompt_tokens)
                sample.correct = correct
                group.samples.append(sample)
                continue
            tokens = max(1, round(draw() * scale))
            truncated = False
            if cap is not None and tokens > cap:
                tokens, truncated = cap, True
            group.samples.append(
                SimSample(group, index, prompt_tokens, tokens, truncated, correct=correct)
            )
        group.unfinished = group.unscored = workload.group_size
        return group

    def _episode(self, group: Group, index: int, prompt_tokens: int) -> SimSample:
        """A multi-turn episode: its tool calls, then per policy turn a length (capped
        per turn), and per call a latency and an observation length."""
        cap = self.scenario.workload.max_response_tokens
        calls = max(0, round(self._turns.next()))
        turns = [max(1, round(self._response_lengths.next())) for _ in range(calls + 1)]
        truncated = cap is not None and turns[-1] > cap
        if cap is not None:
            turns = [min(tokens, cap) for tokens in turns]
        tool_s = tuple(max(0.0, self._tool_s.next()) for _ in range(calls))
        observations = tuple(max(0, round(self._observations.next())) for _ in range(calls))
        return SimSample(
            group,
            index,
            prompt_tokens,
            sum(turns) + sum(observations),
            truncated,
            turn_tokens=tuple(turns),
            tool_s=tool_s,
            observations=observations,
        )

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
