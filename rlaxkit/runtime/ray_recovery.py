"""How a ``RayExperiment`` keeps its fleet and heals its actors.

Split from ``rlaxkit.runtime.ray_backend`` (one concept per module), as the local
backend keeps its faults in ``rlaxkit.runtime.recovery``. Deaths are found when a call
to the actor fails (``RayActorError``), so they cost nothing until then:

- **worker**: its in-flight prompts keep their place in the books
  (``buffer.reset_group``) and go back to the controller (``requeue``: same ids, same
  seeds), exactly as the local backend's ``preempt_worker`` does; a new worker actor
  takes its place (``RayConfig.replace_dead_workers``) and pulls before its first prompt.
- **parameter server**: Ray restarts it (``max_restarts``) empty; at the next round the
  driver sees it holds less than the trainer published and has the trainer register its
  newest object again (no new copy: the trainer owns it).
- **trainer**: Ray restarts it (``max_restarts``; a multi-process trainer is stopped
  and started anew as a whole by the driver: ``rlaxkit.runtime.ray_trainer_group``);
  the driver has it restore its newest checkpoint at or below the driver's step and
  replays the batches trained since (kept until a checkpoint covers them), so the
  state is exactly the one lost and no trained group is undone. This differs from the
  local backend, whose ``preempt_trainer`` rolls the run back to the checkpoint
  (``buffer.rollback``): here the driver, which survives, still holds those batches.
  Weights lost with the trainer (it owned the objects) make workers' pulls fail; the
  driver then recovers the trainer and the workers sync again.

Goodput (``summary``) is the local backend's: the trainer compute of the steps that
survive ÷ wall time; a trainer restart makes the first run of each replayed step lost
compute (``lost_train_s``, ``lost_steps``), and a resumed run the steps taken after
its checkpoint (``rlaxkit.runtime.ray_state``).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError

from rlaxkit.controller import Issue
from rlaxkit.runtime.ray_actors import TrainerRestartedError, WorkerActor

_RECOVERY_WAIT_S = 120.0  # How long a restarting actor may take to answer again.
_SYNC_ATTEMPTS = 10  # Syncs per round before a worker is left to retry next round.


@functools.cache
def remote(cls):
    """``ray.remote(cls)``, made once per class."""
    return ray.remote(cls)


def stop_actor(handle: Any, timeout_s: float = 30.0) -> None:
    """Asks an actor to ``close`` (release its pools and files), then kills it."""
    with contextlib.suppress(RayActorError, ray.exceptions.GetTimeoutError):
        ray.get(handle.close.remote(), timeout=timeout_s)
    ray.kill(handle)


@dataclass
class WorkerSlot:
    """The driver's view of one worker actor: what it holds in flight."""

    worker_id: str
    handle: Any
    in_flight: dict[int, Issue] = field(default_factory=dict)
    generated_tokens: int = 0
    failed_pulls: int = 0


class RayFaultHandling:
    """The fleet and fault recovery of ``RayExperiment`` (uses its config, buffer,
    controller, trace, trainer group and replay log)."""

    # -- the fleet ---------------------------------------------------------------------
    def scale_workers(self, n: int) -> WorkerSlot | None:
        """Grows or shrinks the fleet to ``n`` worker actors, now; returns the newest
        worker (``None`` when the fleet is empty).

        New workers pull the newest weights before their first prompt. Removed workers
        (the newest first) lose their in-flight prompts, which are re-issued to the
        others with the same ids and seeds; the staleness policy applies unchanged.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"scale_workers: n must be an int >= 0, got {n!r}")
        while len(self.workers) < n:
            self._add_worker()
        while len(self.workers) > n:
            slot = self.workers[-1]
            self._lose_worker(slot, "scaled_down")
            stop_actor(slot.handle)
        return self.workers[-1] if self.workers else None

    def _add_worker(self, worker_id: str | None = None) -> WorkerSlot:
        """Starts a worker actor named ``worker_id`` (default: the next free name)."""
        if worker_id is None:
            worker_id = f"worker-{self._next_worker}"
            self._next_worker += 1
        options = {**self.ray_config.worker.options(), "max_restarts": 0, "max_task_retries": 0}
        handle = (
            remote(WorkerActor)
            .options(**options)
            .remote(
                worker_id,
                self.config,
                self.graphdef,
                self.tokenizer,
                self.store,
                self._t0_wall,
                self._jax_options,
            )
        )
        slot = WorkerSlot(worker_id, handle)
        self.workers.append(slot)
        return slot

    def _lose_worker(self, slot: WorkerSlot, reason: str) -> None:
        """Takes ``slot`` out of the fleet; its in-flight prompts are queued again."""
        lost = sorted(slot.in_flight.values(), key=lambda issue: issue.group_id)
        for issue in lost:
            self.buffer.reset_group(issue.group_id)
        self.controller.requeue(lost)
        self._retired_tokens += slot.generated_tokens
        self._retired_failed_pulls += slot.failed_pulls
        self.workers.remove(slot)
        self.trace.record(
            self.clock(), "preemption", slot.worker_id, None, reason=reason, reissued=len(lost)
        )

    def _call_workers(
        self, method: str, args: dict[str, tuple], only: list[str] | None = None
    ) -> dict[str, Any]:
        """Calls ``method`` on every worker (or those named in ``only``) at once;
        returns replies by worker id.

        A worker that died is taken out of the fleet (and replaced, if configured)."""
        refs = [
            (slot, getattr(slot.handle, method).remote(*args.get(slot.worker_id, ())))
            for slot in list(self.workers)
            if only is None or slot.worker_id in only
        ]
        replies, dead = {}, []
        for slot, ref in refs:
            try:
                replies[slot.worker_id] = ray.get(ref)
            except RayActorError:
                dead.append(slot)
        for slot in dead:
            self._lose_worker(slot, "actor_died")
            ray.kill(slot.handle)
            if self.ray_config.replace_dead_workers:
                self._replacements += 1
                if self._replacements > self.ray_config.max_worker_replacements:
                    raise RuntimeError(
                        f"{self._replacements} worker actors died; giving up (raise "
                        "RayConfig.max_worker_replacements if the cluster is really that "
                        "unreliable, else look at the workers' logs)"
                    )
                new = self._add_worker()
                self.trace.record(
                    self.clock(), "restart", new.worker_id, None, replaces=slot.worker_id
                )
        return replies

    # -- the trainer and the parameter server ------------------------------------------
    def _call_restarting(self, method: str, *args: Any) -> Any:
        """Calls the trainer once, waiting while Ray restarts it (a group of trainer
        processes was restarted by :meth:`_recover_trainer` already)."""
        if self.trainer_group.size > 1:
            return self.trainer_group.call(method, *args)
        deadline = time.perf_counter() + _RECOVERY_WAIT_S
        while True:
            try:
                return self.trainer_group.call(method, *args)
            except RayActorError as error:
                if time.perf_counter() > deadline or "max_restarts" in str(error):
                    raise RuntimeError(
                        f"the trainer actor is gone ({type(error).__name__}); it may have "
                        "used up RayConfig.trainer_max_restarts: see its log"
                    ) from error
                time.sleep(0.2)

    def _trainer(self, method: str, *args: Any) -> Any:
        """Calls the trainer; if it died or came back with a fresh state, restores it
        (:meth:`_recover_trainer`) and calls again."""
        for _ in range(self.ray_config.trainer_max_restarts + 1):
            try:
                return self.trainer_group.call(method, *args)
            except (RayActorError, TrainerRestartedError):
                self._recover_trainer()
        raise RuntimeError(
            f"the trainer failed {self.ray_config.trainer_max_restarts + 1} times in a row "
            f"at step {self.version}; see its log"
        )

    def _train(self, batch) -> dict[str, Any]:
        step = self.version + 1
        self._replay.append((step, batch))  # until a checkpoint covers it
        result = self._trainer("train", batch, step)
        if self.config.weight_sync.should_push(step):
            self._published = step
        return result

    def _recover_trainer(self) -> None:
        """Restores the restarted trainer and replays the batches since its checkpoint,
        so its state is the one it lost; then it publishes again."""
        self.trace.record(self.clock(), "preemption", "trainer", self.version)
        self.trainer_group.restart()  # A group starts anew; one trainer Ray restarts.
        restored = self._call_restarting("restore", self.version)
        replay = [(s, b) for s, b in self._replay if restored < s <= self.version]
        if [s for s, _ in replay] != list(range(restored + 1, self.version + 1)):
            raise RuntimeError(
                f"the trainer restored step {restored} but the driver no longer holds the "
                f"batches of steps {restored + 1}..{self.version}"
            )
        for step, batch in replay:
            result = self._call_restarting("train", batch, step, False)
            self.trace.extend(result["events"])
            # The step's first run was lost compute; the replay is what survives.
            self.lost_train_s += self.useful_train_s[step - 1]
            self.useful_train_s[step - 1] = result["duration_s"]
        self.lost_steps += len(replay)
        reply = self._call_restarting("publish", self.version, True)
        self.trace.extend(reply["events"])
        self._published = reply["version"]
        self.trace.record(
            self.clock(), "restart", "trainer", self.version, lost_steps=self.version - restored
        )

    def _ensure_published(self) -> int | None:
        """The published version; has the trainer publish again if the store lost it."""
        latest = self.param_server.latest_version()
        if latest is None or latest < self._published:
            self.trace.record(self.clock(), "restart", "param_server", latest)
            reply = self._trainer("publish", self.version)
            self.trace.extend(reply["events"])
            latest = reply["version"]
        return latest

    def _sync_workers(self) -> dict[str, Any]:
        """Every worker pulls if it must; returns their replies (rooms).

        A worker whose sync could not do what the local loop would (weights lost with a
        dead trainer, a failed pull, an empty store while the parameter server
        restarts) changed nothing; the driver repairs the store (recovering the trainer
        first if its objects died) and has it sync again, so the round stays the one
        the local loop would run.
        """
        rooms = self._call_workers("sync", {})
        for _ in range(_SYNC_ATTEMPTS):
            retry = [w for w, reply in rooms.items() if reply["retry"]]
            if not retry:
                break
            if any(rooms[w]["weights_lost"] for w in retry):
                self._trainer("publish", self.version)  # Restores a dead trainer first.
            self._ensure_published()
            for worker_id, reply in self._call_workers("sync", {}, only=retry).items():
                reply["events"] = rooms[worker_id]["events"] + reply["events"]
                rooms[worker_id] = reply
        return rooms

    # -- goodput ---------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Goodput (useful trainer compute ÷ wall time), lost steps and fault counters,
        with the local backend's keys where they mean the same here.

        ``useful_train_s`` is the train steps' compute as the trainer actor times it
        (batch transfer excluded); ``worker_replacements`` counts dead worker actors
        replaced; ``restarts`` counts ``restart`` trace events by actor.
        """
        wall = self.clock()
        useful = sum(self.useful_train_s)
        restarts: dict[str, int] = {}
        for event in self.trace.memory.events:
            if event.kind == "restart":
                actor = "worker" if event.actor.startswith("worker-") else event.actor
                restarts[actor] = restarts.get(actor, 0) + 1
        return {
            "backend": "ray",
            "goodput": useful / max(wall, 1e-9),
            "useful_train_s": useful,
            "lost_train_s": self.lost_train_s,
            "lost_steps": self.lost_steps,
            "wall_s": wall,
            "steps": self.version,
            "rounds": self.rounds,
            "accepted_lost": len(self.buffer.accepted_lost()),
            "failed_pulls": self._retired_failed_pulls + sum(w.failed_pulls for w in self.workers),
            "workers": len(self.workers),
            "worker_replacements": self._replacements,
            "restarts": restarts,
            "buffer": self.buffer.counts(),
            "resumed_from": self.resumed_from,
        }
