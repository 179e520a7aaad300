"""Rollout groups and their samples, and a worker's request for the next group.

The data every entity passes around (the buffer admits groups, workers and the serial
host decode their samples, the verifier scores them), kept apart from the buffer so
that ``sim.entities.context`` can name them without importing any entity.
"""

from __future__ import annotations

import simpy

__all__ = ["Group", "SimSample", "StartRequest"]


class SimSample:
    """One generated sequence of a group: a single-turn completion, or a multi-turn
    episode whose policy turns are ``turn_tokens``, separated by tool calls that take
    ``tool_s`` seconds and append ``observations`` tokens. ``tokens`` is every token
    after the prompt (the environment's included: the trainer trains on the whole
    sequence); ``turn`` is the next turn to decode (0 until the first one is done)."""

    __slots__ = (
        "group",
        "index",
        "prompt_tokens",
        "tokens",
        "truncated",
        "turn_tokens",
        "tool_s",
        "observations",
        "turn",
        "first_version",
        "correct",
    )

    def __init__(
        self,
        group: Group,
        index: int,
        prompt_tokens: int,
        tokens: int,
        truncated: bool,
        *,
        turn_tokens: tuple[int, ...] | None = None,
        tool_s: tuple[float, ...] = (),
        observations: tuple[int, ...] = (),
        correct: bool = False,
    ) -> None:
        self.group = group
        self.index = index
        self.prompt_tokens = prompt_tokens
        self.tokens = tokens
        self.truncated = truncated
        self.turn_tokens = (tokens,) if turn_tokens is None else turn_tokens
        self.tool_s = tool_s
        self.observations = observations
        self.turn = 0
        self.first_version: int | None = None
        self.correct = correct  # its reward (``WorkloadSpec.pass_rate``), for the audit

    @property
    def sample_id(self) -> str:
        return f"{self.group.group_id}/{self.index}"

    @property
    def policy_tokens(self) -> int:
        """Tokens the policy sampled (every turn's)."""
        return sum(self.turn_tokens)

    def context_tokens(self, turn: int) -> int:
        """Tokens before policy turn ``turn``: the prompt, the turns before it and their
        observations (what a turn that starts over in a new slot prefills)."""
        return self.prompt_tokens + sum(self.turn_tokens[:turn]) + sum(self.observations[:turn])

    def again(self, group: Group) -> SimSample:
        """The same sample of ``group`` generated again from scratch."""
        return SimSample(
            group,
            self.index,
            self.prompt_tokens,
            self.tokens,
            self.truncated,
            turn_tokens=self.turn_tokens,
            tool_s=self.tool_s,
            observations=self.observations,
            correct=self.correct,
        )


class Group:
    """One prompt and its samples, generated on one worker.

    ``first_version``/``last_version`` are the oldest and newest weight versions any of
    its tokens were sampled with; ``lineage`` is the store's lineage of those weights. A
    generation that was lost and handed out again is ``void`` (its late results are
    ignored); :meth:`regenerate` is the new one.
    """

    __slots__ = (
        "group_id",
        "worker",
        "samples",
        "unfinished",
        "unscored",
        "started",
        "failed",
        "void",
        "first_version",
        "last_version",
        "lineage",
        "tokens",
        "scored_at",
    )

    def __init__(self, group_id: int, worker: str = "") -> None:
        self.group_id = group_id
        self.worker = worker
        self.samples: list[SimSample] = []
        self.unfinished = 0
        self.unscored = 0
        self.started = False
        self.failed = False
        self.void = False
        self.first_version: int | None = None
        self.last_version: int | None = None
        self.lineage = 0
        self.tokens = 0
        self.scored_at = 0.0

    def regenerate(self) -> Group:
        """The same prompt generated again from scratch: same id, same lengths."""
        group = Group(self.group_id)
        group.samples = [sample.again(group) for sample in self.samples]
        group.unfinished = group.unscored = len(group.samples)
        return group

    def note_version(self, version: int, lineage: int) -> None:
        """Record that some of its tokens were sampled with ``version``."""
        first, last = self.first_version, self.last_version
        if first is None or last is None:
            self.first_version = self.last_version = version
            self.lineage = lineage
            return
        self.first_version = min(first, version)
        self.last_version = max(last, version)
        self.lineage = min(self.lineage, lineage)

    @property
    def versions(self) -> tuple[int, int]:
        """``(first_version, last_version)``; a group has them from its first token on."""
        first, last = self.first_version, self.last_version
        if first is None or last is None:
            raise ValueError(f"group {self.group_id}: no token sampled yet, so no versions")
        return first, last


class StartRequest(simpy.Event):
    """A request of ``worker`` to start a generation
    (:meth:`sim.entities.buffer.SimBuffer.wait_start`), granted in FIFO order with the
    group to generate as its value; a preempted worker withdraws it (``cancelled``)."""

    def __init__(self, env: simpy.Environment, worker: str) -> None:
        super().__init__(env)
        self.worker = worker
        self.cancelled = False
