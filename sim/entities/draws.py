"""A simulation's draws from its workload: each new prompt group's lengths, episodes
and outcomes, every kind from a seeded stream of its own."""

from __future__ import annotations

from sim.distributions import CorrelatedLengths, Stream, Uniform
from sim.entities.groups import Group, SimSample
from sim.scenario import Scenario

__all__ = ["WorkloadDraws"]


class WorkloadDraws:
    """New prompt groups for ``scenario`` (``created`` counts them)."""

    def __init__(self, scenario: Scenario) -> None:
        workload = self.workload = scenario.workload
        self.created = 0
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

    def new_group(self) -> Group:
        """A new prompt group with lengths drawn from the workload distributions."""
        workload = self.workload
        group = Group(self.created)
        self.created += 1
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
        cap = self.workload.max_response_tokens
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
