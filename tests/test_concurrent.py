"""The local runtime's concurrent mode: worker threads, staleness bound, books, teardown."""

import threading

import pytest

from rlaxkit.config.run import small_run_config
from rlaxkit.runtime import Experiment

# The tiny run of test_runtime.py: a 2-layer, 32-wide char model, short warm start.
SMALL = [
    "runtime.mode=concurrent",
]


def trained_staleness(exp):
    return [s for e in exp.trace.memory.events if e.kind == "train_step" for s in e["staleness"]]


@pytest.mark.parametrize("pull", ["between_requests", "in_flight"])
def test_concurrent_run_keeps_the_staleness_bound_and_the_books(cache, pull):
    threads_before = threading.active_count()
    config = small_run_config(*SMALL, "staleness.max_staleness=1", f"weight_sync.pull_mode={pull}")
    with Experiment(config, cache_dir=cache) as exp:
        history = exp.run(5)
        assert [m["step"] for m in history] == [1, 2, 3, 4, 5]
        # One thread per worker, and one the shared reward runner scores inline
        # rewards in off the main thread (so it can hold them to their timeout).
        assert threading.active_count() == threads_before + config.runtime.num_workers + 1
        for metrics in history:
            assert 0 <= metrics["staleness/max"] <= 1
        # Workers run ahead while the trainer trains: a step may find its batch ready.
        assert sum(m["throughput/samples_per_s"] for m in history) > 0
        exp.check_accounting()  # mid-run, workers still decoding
    assert threading.active_count() == threads_before  # close() joined every thread
    exp.check_accounting()
    counts = exp.buffer.counts()
    assert counts["trained"] == 5 * config.staleness.batch_size
    assert max(trained_staleness(exp)) <= 1
    # Admission: never more than (η + published + 1) · batch accepted or running.
    assert exp.buffer.accepted + exp.buffer.in_flight <= (1 + exp.version + 1) * 4
    workers = {r.worker_id for g in exp.last_batch["groups"] for r in g.rollouts}
    assert workers <= {"worker-0", "worker-1"}
    pulls = {e.actor for e in exp.trace.memory.events if e.kind == "pull"}
    assert pulls == {"worker-0", "worker-1"}  # both threads worked


def test_eta_zero_trains_only_on_policy_rollouts(cache):
    with Experiment(small_run_config(*SMALL, "staleness.max_staleness=0"), cache_dir=cache) as exp:
        for metrics in exp.run(4):
            assert metrics["staleness/max"] == 0
            assert abs(metrics["train/ratio_mean"] - 1.0) <= 1e-4
        exp.check_accounting()
    assert set(trained_staleness(exp)) == {0}
    for group in exp.last_batch["groups"]:
        for rollout in group.rollouts:
            assert set(rollout.versions.tolist()) == {exp.version - 1}


def test_worker_thread_exception_surfaces_in_step(cache):
    threads_before = threading.active_count()
    with Experiment(
        small_run_config(*SMALL),
        cache_dir=cache,
    ) as exp:
        exp.step()

        def broken():
            raise OSError("decode failed on purpose")

        exp.workers[1].handle.worker.step = broken
        with pytest.raises(RuntimeError, match="worker-1 failed in its thread") as info:
            for _ in range(20):  # worker-1 fails at its next chunk, within one step
                exp.step()
        assert isinstance(info.value.__cause__, OSError)
        with pytest.raises(RuntimeError, match="worker-1 failed"):
            exp.step()  # stays failed
    assert threading.active_count() == threads_before


def test_close_without_steps_starts_no_thread_and_a_closed_run_refuses_steps(cache):
    threads_before = threading.active_count()
    exp = Experiment(
        small_run_config(*SMALL),
        cache_dir=cache,
    )
    exp.close()
    exp.close()  # idempotent
    assert threading.active_count() == threads_before
    with pytest.raises(RuntimeError, match="closed"):
        exp.step()


def test_faults_and_checkpoints_are_rejected_naming_the_fix(cache, tmp_path):
    plan = [{"kind": "preempt_worker", "at_step": 2, "target": "worker-0"}]
    with pytest.raises(ValueError, match=r"faults: .*runtime.mode=deterministic"):
        Experiment(
            small_run_config(*SMALL),
            cache_dir=cache,
            faults=plan,
            run_dir=tmp_path / "a",
        )
    for field, value in (("every_steps", "2"), ("every_s", "30")):
        with pytest.raises(ValueError, match=rf"checkpoint.{field}: .*runtime.mode=determ"):
            Experiment(small_run_config(*SMALL, f"checkpoint.{field}={value}"), cache_dir=cache)
