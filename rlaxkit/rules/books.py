"""The run's books: where the loop is, what it saved, what its compute bought.

Plain dataclasses with ``state_dict`` / ``load_state_dict``, held by the driver and
written into every checkpoint by one codec (``rlaxkit.runtime.state``). Nothing here
knows which backend runs the loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PREEMPTIONS = ("worker", "slice", "trainer", "param_server")


@dataclass
class RunBooks:
    """The loop's position and its goodput books.

    Attributes:
        version: the trainer's weight version (= train steps taken and kept).
        rounds: fleet rounds so far (the deterministic fault clock counts them).
        last_save_step: the step of the newest checkpoint (0 before any).
        last_save_s: the fault clock at that checkpoint.
        useful_train_s: compute seconds of each step the current weights descend from.
        lost_train_s: compute seconds of steps that were lost (and taken again).
        lost_steps: how many such steps.
        history: every kept step's metrics.
        extra: the caller's JSON, saved with every checkpoint (``rlaxkit train`` keeps
            its evaluations here).
        resumed_from: the checkpoint step this process resumed from (``None``: fresh).
        preemptions: preemptions so far by kind (``worker``, ``slice``, ``trainer``,
            ``param_server``): a fault plan's, and actors that died on their own.
        restarts: restart events so far by actor (``worker`` for any worker).
        reissued: prompts handed out again after the worker holding them was lost.
        first_reward_error: the first reward failure a finished sample carried (its
            reason and detail; not saved): what a run whose rewards fail reports.
        window: the counters since the previous step, for its throughput metrics (not
            saved: a resumed run starts a new window).
    """

    version: int = 0
    rounds: int = 0
    last_save_step: int = 0
    last_save_s: float = 0.0
    useful_train_s: list[float] = field(default_factory=list)
    lost_train_s: float = 0.0
    lost_steps: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    resumed_from: int | None = None
    preemptions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PREEMPTIONS, 0))
    restarts: dict[str, int] = field(default_factory=dict)
    reissued: int = 0
    first_reward_error: str | None = None
    window: Window = field(default_factory=lambda: Window())

    def record_step(self, duration_s: float) -> None:
        """A train step was taken in ``duration_s`` compute seconds."""
        self.version += 1
        self.useful_train_s.append(duration_s)

    def redo_step(self, step: int, duration_s: float) -> None:
        """Step ``step`` was taken again (a restarted trainer replayed it): its first
        run becomes lost compute."""
        self.lost_train_s += self.useful_train_s[step - 1]
        self.useful_train_s[step - 1] = duration_s
        self.lost_steps += 1

    def roll_back(self, step: int) -> None:
        """The trainer went back to checkpoint ``step``: the steps after it are lost (and
        leave the history: it holds each kept step once)."""
        lost = self.useful_train_s[step:]
        self.lost_steps += len(lost)
        self.lost_train_s += sum(lost)
        del self.useful_train_s[step:]
        self.history = [row for row in self.history if row["step"] <= step]
        self.version = step

    def counters(self) -> dict[str, int]:
        """The fault counters a step's metrics carry (``preemptions/<kind>``,
        ``reissued/prompts``); restarts stay in the summary (a resumed run restarts
        the trainer where the uninterrupted one did not)."""
        out = {f"preemptions/{kind}": n for kind, n in self.preemptions.items()}
        out["reissued/prompts"] = self.reissued
        return out

    def saved(self, fault_clock_s: float) -> None:
        """A checkpoint of the current version was written."""
        self.last_save_step, self.last_save_s = self.version, fault_clock_s

    def state_dict(self) -> dict[str, object]:
        """What a checkpoint keeps (``history`` and ``extra`` go in items of their own)."""
        return {
            "step": self.version,
            "rounds": self.rounds,
            "last_save_s": self.last_save_s,
            "useful_train_s": list(self.useful_train_s),
            "lost_train_s": self.lost_train_s,
            "lost_steps": self.lost_steps,
            "preemptions": dict(self.preemptions),
            "restarts": dict(self.restarts),
            "reissued": self.reissued,
        }

    def load_state_dict(
        self, state: dict[str, Any], history: list[dict[str, Any]], extra: Mapping[str, object]
    ) -> None:
        """Continues from a checkpoint's books (losses already counted are added)."""
        self.version = self.last_save_step = self.resumed_from = state["step"]
        self.rounds = state["rounds"]
        self.last_save_s = state["last_save_s"]
        self.useful_train_s = list(state["useful_train_s"])
        self.lost_train_s += state["lost_train_s"]
        self.lost_steps += state["lost_steps"]
        self.preemptions |= state.get("preemptions", {})  # .get: written before counters
        for actor, n in state.get("restarts", {}).items():
            self.restarts[actor] = self.restarts.get(actor, 0) + n
        self.reissued = state.get("reissued", 0)
        self.history = list(history)
        self.extra = dict(extra)


@dataclass
class Window:
    """Counters since the previous step, for that step's throughput metrics."""

    t: float = 0.0
    tokens: int = 0
    samples: int = 0

    def close(self, t: float, tokens: int) -> dict[str, float]:
        """Throughput over the window that ends at ``t``; starts the next one."""
        elapsed = max(t - self.t, 1e-9)
        out = {
            "throughput/tokens_per_s": (tokens - self.tokens) / elapsed,
            "throughput/samples_per_s": self.samples / elapsed,
        }
        self.t, self.tokens, self.samples = t, tokens, 0
        return out
