"""What a simulated worker (``sim.entities.worker.SimWorker``) keeps besides its samples:
the mode its scenario fixes, who waits on its slots, and the faults in force."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import simpy

__all__ = ["Health", "SlotWaits", "WorkerMode"]


@dataclass(frozen=True)
class WorkerMode:
    """What a worker's scenario fixes for its whole run."""

    host_scope: bool  # decode speed follows the occupancy of the host's workers
    interrupting: bool  # a pull interrupts decoding (in-flight weight updates)
    releases: bool  # multi-turn slots give up their row to a tool past release_after_s


@dataclass
class SlotWaits:
    """Who waits on the worker's slots: idle slots (woken one at a time, FIFO), the one
    slot asking the buffer to admit a group (and the event that lets an episode back
    from its tool take it instead), and decodes paused for a pull or a busy host."""

    resumed: simpy.Event
    idle: deque[simpy.Event] = field(default_factory=deque)
    requesting: bool = False
    wake_request: simpy.Event | None = None


@dataclass
class Health:
    """Faults in force: the end of the current downtime, and a slowdown (its factor, and
    a token that lets only the latest slowdown end it)."""

    down_until: float = 0.0
    slow_factor: float = 1.0
    slow_token: int = 0
