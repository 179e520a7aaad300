"""How the local ``Experiment`` injects faults and recovers from them.

Split from ``rlaxkit.runtime.local`` to keep one concept per module: this mixin holds
what happens when a fault of the plan fires (see ``rlaxkit.runtime.injection`` for the
semantics of each kind) and how the trainer comes back from its last checkpoint.
"""

from __future__ import annotations

from rlaxkit.faults import Fault
from rlaxkit.runtime import state as checkpoint_state


class FaultHandling:
    """Fault injection and recovery for ``Experiment`` (uses its workers, buffer,
    controller, parameter server, trace and checkpoints)."""

    def _apply(self, fault: Fault) -> None:
        """Injects one fault (see ``rlaxkit.runtime.injection``)."""
        now, faults = self.fault_now(), self.faults
        down = faults.downtime(fault)
        if fault.kind in ("preempt_worker", "preempt_slice"):
            for worker_id in faults.targets(fault):
                self.preempt_worker(worker_id, down_s=down)
            return
        if fault.kind == "preempt_trainer":
            self.preempt_trainer(down_s=down)
            return
        actor = {"kill_param_server": "param_server", "hang_reward": "verifier"}
        self.trace.record(
            self.clock(),
            "fault",
            fault.target or actor.get(fault.kind, "controller"),
            None,
            fault=fault.kind,
            logical_s=now,
        )
        if fault.kind == "kill_param_server":
            self.param_server.kill(now + down)
        elif fault.kind == "slow_worker":
            faults.slow[fault.target] = [fault.factor, now + fault.duration_s, 0.0]
        elif fault.kind == "fail_pull":
            self.param_server.failing[fault.target or "*"] += fault.count
        elif fault.kind == "hang_reward":
            self.scorer.inject_hang(fault.count)

    def preempt_worker(self, worker_id: str, down_s: float = 0.0) -> None:
        """Takes a worker down for ``down_s`` fault-clock seconds; its in-flight prompts
        are re-issued (same ids and seeds) to whichever worker has room."""
        worker = next(w for w in self.workers if w.worker_id == worker_id)
        lost = worker.preempt()
        for issue in lost:
            self.buffer.reset_group(issue.group_id)
        self.controller.requeue(lost)
        self.faults.worker_down[worker_id] = self.fault_now() + down_s
        self.trace.record(
            self.clock(), "preemption", worker_id, None, reissued=len(lost), down_s=down_s
        )

    def _restarts(self, now: float) -> None:
        for worker_id, until in sorted(self.faults.worker_down.items()):
            if now >= until:
                del self.faults.worker_down[worker_id]
                self.trace.record(self.clock(), "restart", worker_id, None)
        if self.param_server.tick(now):
            self.trace.record(
                self.clock(), "restart", "param_server", self.param_server.latest_version()
            )

    def preempt_trainer(self, down_s: float = 0.0) -> None:
        """The trainer loses its progress since the last checkpoint; after ``down_s``
        fault-clock seconds it restores that checkpoint and goes on."""
        if self.checkpoints is None:
            raise ValueError("preempt_trainer: the experiment has no run_dir to restore from")
        self.faults.trainer_down_until = self.fault_now() + down_s
        self.trace.record(
            self.clock(),
            "preemption",
            "trainer",
            self.version,
            lost_steps=self.version - self.last_save_step,
        )

    def _restore_trainer(self) -> None:
        start = self.clock()
        self.trace.record(start, "restart", "trainer", self.version)
        state, meta = checkpoint_state.load_train_state(self)
        restored, lost_groups = meta["step"], []
        for step in sorted(self.trained_since_save):
            if step > restored:
                lost_groups.extend(self.trained_since_save.pop(step))
        lost = self.useful_train_s[restored:]
        self.lost_steps += len(lost)
        self.lost_train_s += sum(lost)
        del self.useful_train_s[restored:]
        self.state, self.version = state, restored
        self.faults.trainer_down_until = None
        for group_id in self.buffer.rollback(restored, lost_groups):
            self._drop_event(group_id, "rolled_back")
        self.param_server.rollback(restored, self.state.params)
        for worker in self.workers:  # weights of the discarded branch are void
            if worker.version is not None and worker.version > restored:
                lost_issues = worker.preempt()
                for issue in lost_issues:
                    self.buffer.reset_group(issue.group_id)
                self.controller.requeue(lost_issues)
        self.trace.record(
            self.clock(),
            "checkpoint_restore",
            "trainer",
            restored,
            step=restored,
            duration_s=self.clock() - start,
        )
