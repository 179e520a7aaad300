"""The parameter server a fault plan injects into, in this process: outages, failing
pulls (per worker) and a new lineage when the trainer restores an older checkpoint.
``rlaxkit.runtime.faults`` fires the plan; on Ray the outages are real instead."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["ParameterServerUnavailable", "UnreliableParameterServer"]


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
        weights_of: ``(version, what the trainer pushed) -> full weights``, for the
            checkpoint of a push an outage holds back (default: the push itself; a LoRA
            run pushes adapter records).
        push_of: ``(version, full weights) -> what to push``, for that push restored
            from a checkpoint (default: the weights themselves).
    """

    def __init__(
        self,
        make_store: Callable[[], Any],
        weights_of: Callable[[int, Any], Any] | None = None,
        push_of: Callable[[int, Any], Any] | None = None,
    ):
        self._make_store = make_store
        self._weights_of = weights_of or (lambda version, pushed: pushed)
        self._push_of = push_of or (lambda version, weights: weights)
        self.store = make_store()
        self.down_until: float | None = None
        self.failing: Counter[str] = Counter()
        self.pending: tuple[int, Any] | None = None
        self.lineage = 0
        self._known: int | None = None

    # -- the trainer's side ---------------------------------------------------------
    def push(self, version: int, params: object) -> None:
        """Publishes now, or when the store is back if it is down (newest wins)."""
        if self.down_until is not None:
            self.pending = (version, jax.tree.map(jnp.copy, params))
            return
        self.store.push(version, params)
        self._known = version

    def pull(self, min_version: int | None = None, timeout: float | None = None) -> Any:
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

    def rollback(self, version: int, params: object) -> None:
        """Starts a new lineage at ``version`` (the trainer restored an older checkpoint)."""
        self.store = self._make_store()
        self.store.push(version, params)
        self._known, self.pending = version, None
        self.lineage += 1

    def view(self, worker_id: str) -> _WorkerView:
        """The store as worker ``worker_id`` reaches it."""
        return _WorkerView(self, worker_id)

    def held_weights(self) -> dict[int, object]:
        """``{version: full weights}`` of a push the outage holds back (the checkpoint
        saves them; ``state_dict`` names the version)."""
        if self.pending is None:
            return {}
        version, pushed = self.pending
        return {version: self._weights_of(version, pushed)}

    def state_dict(self) -> dict[str, object]:
        """Outage, failing pulls and lineage (weights are saved by the checkpoint)."""
        return {
            "down_until": self.down_until,
            "failing": dict(self.failing),
            "pending_version": None if self.pending is None else self.pending[0],
            "lineage": self.lineage,
        }

    def load_state_dict(self, state: dict[str, Any], weights_for: Callable[[int], object]) -> None:
        self.down_until = state["down_until"]
        self.failing = Counter(state["failing"])
        pending = state["pending_version"]
        if pending is not None:  # a copy, as push keeps one
            weights = jax.tree.map(jnp.copy, weights_for(pending))
            self.pending = (pending, self._push_of(pending, weights))
        else:
            self.pending = None
        self.lineage = state["lineage"]


class _WorkerView:
    """One worker's connection to an ``UnreliableParameterServer``."""

    def __init__(self, server: UnreliableParameterServer, worker_id: str):
        self.server, self.worker_id = server, worker_id

    def latest_version(self) -> int | None:
        return self.server.latest_version()

    def push(self, version: int, params: object) -> None:
        raise RuntimeError("workers do not push weights")

    def pull(self, min_version: int | None = None, timeout: float | None = None) -> Any:
        failing = self.server.failing
        key = self.worker_id if failing[self.worker_id] > 0 else "*"
        if self.server.down_until is None and failing[key] > 0:
            failing[key] -= 1
            raise ParameterServerUnavailable("injected pull failure", "fail_pull")
        return self.server.pull(min_version, timeout)
