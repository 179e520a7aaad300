"""What the local and Ray backends share: the train-batch buckets and step metrics."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlaxkit.data.batch import BucketSpec
from rlaxkit.data.rollout import Rollout, RolloutGroup
from rlaxkit.observe.metrics import replace_lines
from rlaxkit.rules.trace import JsonlTraceWriter, MemoryTrace, TraceEvent

# Sequence lengths a train batch is padded to: one step program per length seen.
TRAIN_BUCKETS = BucketSpec(lengths=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096))


def batch_metrics(
    version: int,
    groups: Sequence[RolloutGroup],
    samples: Sequence[Rollout],
    buffer_counts: Mapping[str, Any],
    train_metrics: Mapping[str, float],
) -> dict[str, object]:
    """The learning metrics of the step that produced weight ``version``.

    Staleness of a group is ``version - 1 - first_version`` (the trainer was at
    ``version - 1`` when it took the batch). Keys: ``step``, ``reward/*``,
    ``staleness/*``, ``completion/mean_tokens``, ``batch/equal_reward_groups``,
    ``buffer/*``, ``dropped/<reason>``, ``train/<metric>`` and ``drift/*``; wall-clock keys are the
    caller's.
    """
    rewards = np.array([s.reward for s in samples])
    staleness = np.array([version - 1 - g.first_version for g in groups])
    correct = np.array([s.reward_info["correct"] for s in samples])
    return {
        "step": version,
        "reward/mean": float(rewards.mean()),
        "reward/pass_rate": float(correct.mean()),
        "staleness/mean": float(staleness.mean()),
        "staleness/max": int(staleness.max()),
        "completion/mean_tokens": float(np.mean([s.num_tokens for s in samples])),
        # Groups whose rewards are all equal (zero group-relative advantage): trained
        # only with batching.equal_rewards=keep.
        "batch/equal_reward_groups": sum(
            1 for g in groups if len(g.rollouts) > 1 and g.equal_rewards
        ),
        **{
            f"buffer/{k}": buffer_counts[k] for k in ("in_flight", "buffered", "trained", "dropped")
        },
        **{f"dropped/{k}": v for k, v in buffer_counts["dropped_by_reason"].items()},
        **{k if k.startswith("drift/") else f"train/{k}": v for k, v in train_metrics.items()},
    }


class RunTrace:
    """A run's trace: this process's events in memory (``memory``) and, with a run
    directory, every event appended to its trace.jsonl.

    Args:
        path: the trace.jsonl to append to, or ``None``.
        written: the events the file already holds (those of a run resumed from).
        lock: taken around every event (the local runtime's concurrent mode records from
            worker threads).
        restarts: counts ``restart`` events by actor (``worker`` for any worker) into
            this dict (the run's books).
        memory_limit: with a ``path``, keep about this many of the newest events in
            memory (``RuntimeConfig.trace_memory``): a long run writes two events per
            sample, and the file holds them all. Without a file, memory keeps every event.

    ``written`` counts the file's events; ``offset_s`` is added to every recorded time
    (a resumed run's clock goes on from the stopped run's); ``let_go`` counts the events
    no longer in memory (the oldest first).
    """

    def __init__(
        self,
        path: Path | None,
        written: int,
        lock: threading.RLock,
        restarts: dict[str, int],
        memory_limit: int | None = None,
    ) -> None:
        self.memory = MemoryTrace()
        self.memory_limit = memory_limit if path else None
        self.let_go = 0
        self.restarts = restarts
        self.file = JsonlTraceWriter(path, append=True) if path else None
        self.written = written
        self.offset_s = 0.0
        self.lock = lock

    def record(
        self, t: float, kind: str, actor: str, version: int | None = None, **fields: object
    ) -> None:
        """Validates and records one event at time ``t + offset_s``."""
        self.emit(TraceEvent(t + self.offset_s, kind, actor, version, fields))

    def emit(self, event: TraceEvent) -> None:
        """Records an already-built event."""
        with self.lock:
            self.memory.events.append(event)  # two events a sample: no call more
            limit = self.memory_limit
            if limit is not None and len(self.memory.events) >= limit + limit // 4 + 1:
                # In batches (a quarter of the limit): one slice deletion, not one a call.
                excess = len(self.memory.events) - limit
                del self.memory.events[:excess]
                self.let_go += excess
            if event.kind == "restart":
                actor = "worker" if event.actor.startswith("worker-") else event.actor
                self.restarts[actor] = self.restarts.get(actor, 0) + 1
            if self.file:
                self.file.emit(event)
                self.written += 1

    def extend(self, events: Sequence[TraceEvent]) -> None:
        """Records events built elsewhere (by actors), in order."""
        for event in events:
            self.emit(event)

    def discard_steps(self, steps: set[int]) -> None:
        """Marks the kept ``train_step`` events of ``steps`` ``discarded`` (a trainer
        restore went back over them), in memory and in trace.jsonl (rewritten)."""

        def mark(event: TraceEvent) -> TraceEvent:
            if event.kind != "train_step" or event.discarded or event.get("step") not in steps:
                return event
            return TraceEvent(
                event.t, event.kind, event.actor, event.version, {**event.fields, "discarded": True}
            )

        with self.lock:
            self.memory.events = [mark(event) for event in self.memory.events]
            if self.file:
                path = self.file.path
                self.file.close()
                lines = path.read_text(encoding="utf-8").splitlines()
                replace_lines(
                    path,
                    [
                        mark(TraceEvent.from_dict(json.loads(line))).to_json()
                        if '"train_step"' in line
                        else line
                        for line in lines
                    ],
                )
                self.file = JsonlTraceWriter(path, append=True)

    def close(self) -> None:
        if self.file:
            self.file.close()
