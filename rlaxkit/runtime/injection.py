"""Fault injection for the local runtime: a ``FaultPlan`` fired on the run's fault clock.

The plan format is the simulator's (``rlaxkit.faults``); what each fault does here:

- ``preempt_worker`` / ``preempt_slice``: the worker(s) lose their engine, weights and
  in-flight prompts; the prompts go back to the controller and are re-issued with the
  same ids and seeds; after the downtime the worker restarts empty and pulls the newest
  weights before it takes work.
- ``preempt_trainer``: the trainer's progress since its last checkpoint is lost; after
  the downtime it restores that checkpoint from disk, the parameter server starts a new
  lineage at the restored version, and the workers go on (those holding weights of the
  discarded branch drop them and re-issue their prompts).
- ``kill_param_server``: the store is unreachable for the downtime: pulls fail (counted,
  retried next round), a push waits and is published when it is back.
- ``slow_worker``: the worker decodes one chunk every ``factor`` rounds.
- ``fail_pull``: the next ``count`` pulls of ``target`` (any worker when unset) fail.
- ``hang_reward``: the next ``count`` reward calls hang until the reward timeout.

The fault clock (``Experiment.fault_now``) is logical in deterministic mode: ``rounds ·
runtime.round_s``. A timed fault fires at the start of the first round at or after its
``at_s``; a step fault right after the trainer finishes that step, before it pushes or
saves (as in the simulator, a trainer preempted after step ``s`` loses step ``s``).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from rlaxkit.faults import Fault, FaultPlan

__all__ = ["FaultState", "ParameterServerUnavailable", "UnreliableParameterServer"]


class ParameterServerUnavailable(ConnectionError):
    """A pull failed; ``fault`` names the FaultPlan kind that caused it."""

    def __init__(self, message: str, fault: str):
        super().__init__(message)
        self.fault = fault


class UnreliableParameterServer:
    """The run's parameter server with injectable outages, failing pulls and rollback.

    Implements the ``ParameterServer`` protocol for the trainer; each worker talks to it
    through ``view(worker_id)`` so that failures can target one worker.

    Args:
        make_store: builds an empty store (a new one starts each lineage).
    """

    def __init__(self, make_store: Callable[[], Any]):
        self._make_store = make_store
        self.store = make_store()
        self.down_until: float | None = None
        self.failing: Counter[str] = Counter()
        self.pending: tuple[int, Any] | None = None
        self.lineage = 0
        self._known: int | None = None

    # -- the trainer's side ---------------------------------------------------------
    def push(self, version: int, params: Any) -> None:
        """Publishes now, or when the store is back if it is down (newest wins)."""
        if self.down_until is not None:
            self.pending = (version, jax.tree.map(jnp.copy, params))
            return
        self.store.push(version, params)
        self._known = version

    def pull(self, min_version: int | None = None, timeout: float | None = None):
        """Pulls from the store (raises ``ParameterServerUnavailable`` while it is down)."""
        if self.down_until is not None:
            raise ParameterServerUnavailable("the parameter server is down", "kill_param_server")
        return self.store.pull(min_version, timeout)

    def latest_version(self) -> int | None:
        """The newest version published (while down: the last one anyone could see)."""
        return self._known

    # -- faults ---------------------------------------------------------------------
    def kill(self, until_s: float) -> None:
        """Unreachable until the fault clock reaches ``until_s``."""
        self.down_until = max(self.down_until or 0.0, until_s)

    def tick(self, now_s: float) -> bool:
        """Brings the store back when its downtime is over; returns True if it did."""
        if self.down_until is None or now_s < self.down_until:
            return False
        self.down_until = None
        if self.pending is not None:
            version, params = self.pending
            self.pending = None
            self.push(version, params)
        return True

    def rollback(self, version: int, params: Any) -> None:
        """Starts a new lineage at ``version`` (the trainer restored an older checkpoint)."""
        self.store = self._make_store()
        self.store.push(version, params)
        self._known, self.pending = version, None
        self.lineage += 1

    def view(self, worker_id: str) -> _WorkerView:
        """The store as worker ``worker_id`` reaches it."""
        return _WorkerView(self, worker_id)

    def state_dict(self) -> dict[str, Any]:
        """Outage, failing pulls and lineage (weights are saved by the checkpoint)."""
        return {
            "down_until": self.down_until,
            "failing": dict(self.failing),
            "pending_version": None if self.pending is None else self.pending[0],
            "lineage": self.lineage,
        }

    def load_state_dict(self, state: dict[str, Any], weights_for: Callable[[int], Any]) -> None:
        self.down_until = state["down_until"]
        self.failing = Counter(state["failing"])
        pending = state["pending_version"]
        self.pending = None if pending is None else (pending, weights_for(pending))
        self.lineage = state["lineage"]


class _WorkerView:
    """One worker's connection to an ``UnreliableParameterServer``."""

    def __init__(self, server: UnreliableParameterServer, worker_id: str):
        self.server, self.worker_id = server, worker_id

    def latest_version(self) -> int | None:
        return self.server.latest_version()

    def push(self, version: int, params: Any) -> None:
        raise RuntimeError("workers do not push weights")

    def pull(self, min_version: int | None = None, timeout: float | None = None):
        failing = self.server.failing
        key = self.worker_id if failing[self.worker_id] > 0 else "*"
        if self.server.down_until is None and failing[key] > 0:
            failing[key] -= 1
            raise ParameterServerUnavailable("injected pull failure", "fail_pull")
        return self.server.pull(min_version, timeout)


class FaultState:
    """Which faults have fired and what is down or slow, on the fault clock.

    Args:
        plan: the faults to inject.
        worker_ids: the fleet's worker names.
        workers_per_slice: workers per slice (``slice-i`` holds ``i·k .. i·k+k-1``).
        restart_s: downtime of a fault without ``restart_after_s``.

    Raises:
        ValueError: a fault names a worker or slice this fleet does not have.
    """

    def __init__(
        self, plan: FaultPlan, worker_ids: list[str], workers_per_slice: int, restart_s: float
    ):
        self.plan = plan
        self.restart_s = restart_s
        self.slices: dict[str, list[str]] = {}
        for i, worker in enumerate(worker_ids):
            self.slices.setdefault(f"slice-{i // workers_per_slice}", []).append(worker)
        for index, fault in enumerate(plan):
            where = f"faults[{index}].target"
            if fault.kind in ("preempt_worker", "slow_worker", "fail_pull") and (
                fault.target is not None and fault.target not in worker_ids
            ):
                raise ValueError(f"{where}: no worker named {fault.target!r}; have {worker_ids}")
            if fault.kind == "preempt_slice" and fault.target not in self.slices:
                raise ValueError(
                    f"{where}: no slice named {fault.target!r}; have {sorted(self.slices)} "
                    "(runtime.workers_per_slice sets how workers group into slices)"
                )
        self.fired: set[int] = set()
        self.worker_down: dict[str, float] = {}  # worker -> back at (fault clock)
        self.slow: dict[str, list[float]] = {}  # worker -> [factor, until, credit]
        self.trainer_down_until: float | None = None

    def downtime(self, fault: Fault) -> float:
        return self.restart_s if fault.restart_after_s is None else fault.restart_after_s

    def due_timed(self, now_s: float) -> list[Fault]:
        """Timed faults whose time has come, marked fired, in plan time order."""
        due = []
        for index, fault in sorted(enumerate(self.plan), key=lambda x: (x[1].at_s or 0, x[0])):
            if fault.at_s is not None and index not in self.fired and fault.at_s <= now_s:
                self.fired.add(index)
                due.append(fault)
        return due

    def due_step(self, step: int) -> list[Fault]:
        """Step faults for ``step`` not fired yet (each fires once, even if the step is
        reached again after a trainer restore), marked fired."""
        due = []
        for index, fault in enumerate(self.plan):
            if fault.at_step == step and index not in self.fired:
                self.fired.add(index)
                due.append(fault)
        return due

    def targets(self, fault: Fault) -> list[str]:
        """Worker names a worker or slice fault applies to."""
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

    def waiting(self) -> bool:
        """True while something is down and scheduled to come back."""
        return bool(self.worker_down) or self.trainer_down_until is not None

    def state_dict(self) -> dict[str, Any]:
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


def load_plan(plan: FaultPlan | str | os.PathLike | list | None) -> FaultPlan:
    """A plan given as a ``FaultPlan``, a path to YAML/JSON, a list of fault mappings,
    or ``None`` (no faults)."""
    if plan is None:
        return FaultPlan()
    if isinstance(plan, FaultPlan):
        return plan
    if isinstance(plan, list | tuple):
        return FaultPlan.from_dicts(plan)
    return FaultPlan.load(plan)
