"""The simulated reward service: scores each finished sample after a latency.

A pool of ``concurrency`` verifiers (or unlimited, like RLAX's code verifier on AWS
Lambda, ``docs/papers.md`` [R2]) takes samples first come, first served. Scoring is
scheduled with event callbacks rather than one process per sample, since it is on the hot
path. A ``hang_reward`` fault makes the next calls hang until ``timeout_s``; their group is
then dropped (reason ``reward_timeout``) instead of trained.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, cast

import simpy

from sim.distributions import Constant, Stream
from sim.entities.groups import Group, SimSample

if TYPE_CHECKING:
    from sim.entities.context import SimContext

__all__ = ["VerifierPool"]


class VerifierPool:
    """Scores samples and hands complete groups to the buffer."""

    name = "verifier"

    def __init__(self, sim: SimContext) -> None:
        self.sim = sim
        self.env = sim.env
        self.spec = sim.scenario.verifier
        self._latencies = Stream(self.spec.latency_s, seed=sim.scenario.seed, name="verifier")
        self.busy = 0
        self.queue: deque[SimSample] = deque()
        self.hangs_pending = 0
        latency = self.spec.latency_s
        self._constant = latency.mean() if isinstance(latency, Constant) else None
        # Unlimited verifiers and no trace to write: a group is scored at the latest of
        # its samples' (finish + latency), so one timer per group replaces one per
        # sample. Same draws in the same order, hence the same run.
        self._per_group = self.spec.concurrency is None and sim.trace is None

    def submit(self, sample: SimSample) -> None:
        """Score ``sample`` when a verifier is free."""
        if self._per_group:
            group = sample.group
            group.scored_at = max(group.scored_at, self.env.now + self._latency(sample))
            group.unscored -= 1
            if group.unscored == 0:
                timer = self.env.timeout(group.scored_at - self.env.now, value=group)
                timer.callbacks.append(self._group_done)
            return
        if self.spec.concurrency is not None and self.busy >= self.spec.concurrency:
            self.queue.append(sample)
            return
        self._start(sample)

    def _latency(self, sample: SimSample) -> float:
        if self.hangs_pending > 0:
            self.hangs_pending -= 1
            sample.group.failed = True
            self.sim.record(self.name, "fault", None, fault="hang_reward", sample=sample.sample_id)
            return self.spec.timeout_s
        if self._constant is not None:
            return self._constant
        return self._latencies.next()

    def _group_done(self, event: simpy.Event) -> None:
        self._hand_over(cast(Group, event.value))  # the value its timer got in submit

    def _hand_over(self, group: Group) -> None:
        if group.failed:
            self.sim.buffer.release(group, "reward_timeout")
        else:
            self.sim.buffer.deliver(group)

    def _start(self, sample: SimSample) -> None:
        self.busy += 1
        latency = self._latency(sample)
        timer = self.env.timeout(latency, value=(sample, latency))
        timer.callbacks.append(self._done)

    def _done(self, event: simpy.Event) -> None:
        sample, latency = cast(tuple[SimSample, float], event.value)  # given in _start
        self.busy -= 1
        group = sample.group
        if self.sim.trace is not None and not group.failed:
            self.sim.record(
                self.name, "reward", group.last_version, sample=sample.sample_id, duration_s=latency
            )
        group.unscored -= 1
        if group.unscored == 0:
            self._hand_over(group)
        if self.queue:
            self._start(self.queue.popleft())
