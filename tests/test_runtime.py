"""The local runtime closes the loop: determinism, on-policy ratios, accounting."""

import numpy as np
import pytest

from rlaxkit.algorithms.advantages import grpo_advantages
from rlaxkit.config.run import small_run_config
from rlaxkit.runtime import Experiment

# A few seconds per run: a 2-layer, 32-wide char model with a short warm start.
SMALL = [
    "eval.num_problems=8",
    "eval.samples=2",
]


def learning_metrics(history):
    """Everything but wall-clock timings and fault counters (an actor killed on one
    backend counts there only)."""
    skip = ("time/", "throughput/", "preemptions/", "reissued/")
    return [{k: v for k, v in m.items() if not k.startswith(skip)} for m in history]


def test_deterministic_mode_gives_identical_metrics_for_one_seed(cache):
    runs = []
    for _ in range(2):
        with Experiment(
            small_run_config(*SMALL),
            cache_dir=cache,
        ) as exp:
            exp.run(4)
            runs.append(learning_metrics(exp.history))
            events = exp.trace.memory.events
    assert runs[0] == runs[1]
    # A worker's chunk decodes while the host scores the previous worker's; the trace
    # still times disjoint pieces of the host's time, which add up to no more than the
    # run's, and marks the chunks whose duration is only the wait left over.
    chunks = [e for e in events if e.kind == "decode"]
    assert len({e.actor for e in chunks}) == exp.config.runtime.num_workers >= 2
    assert 0 < sum(e.get("pipelined", False) for e in chunks) < len(chunks)
    timed = [e for e in events if e.kind in ("decode", "reward", "train_step")]
    start = min(e.t - e["duration_s"] for e in timed)
    assert sum(e["duration_s"] for e in timed) <= max(e.t for e in timed) - start
    with Experiment(small_run_config(*SMALL, "seed=1"), cache_dir=cache) as other:
        other.run(4)
        assert learning_metrics(other.history) != runs[0]


def test_eta_zero_is_on_policy_every_ratio_is_one(cache):
    with Experiment(small_run_config(*SMALL, "staleness.max_staleness=0"), cache_dir=cache) as exp:
        for metrics in exp.run(4):
            assert metrics["staleness/max"] == 0
            assert abs(metrics["train/ratio_mean"] - 1.0) <= 1e-4
        # Only fresh rollouts are trained; nothing was ever stale at η = 0.
        assert "dropped/stale" not in exp.history[-1]


def test_accounting_invariant_at_every_step_with_filtering_and_eta_two(cache):
    with Experiment(small_run_config(*SMALL, "staleness.max_staleness=2"), cache_dir=cache) as exp:
        assert exp.config.batching.equal_rewards == "drop"
        seen_stale = 0
        for _ in range(6):
            metrics = exp.step()
            exp.check_accounting()
            seen_stale = max(seen_stale, metrics["staleness/max"])
            counts = exp.buffer.counts()
            assert counts["trained"] == metrics["step"] * exp.config.staleness.batch_size
        assert seen_stale >= 1  # asynchrony really happened
        assert exp.history[-1].get("dropped/filtered", 0) > 0  # and filtering did
        assert exp.buffer.accepted + exp.buffer.in_flight <= (
            (2 + exp.version + 1) * exp.config.staleness.batch_size
        )


def test_equal_rewards_keep_trains_every_group_and_counts_the_equal_ones(cache):
    """batching.equal_rewards=keep: an untrained model fails nearly every prompt, and
    those groups (all rewards 0) train instead of being dropped as ``filtered``; their
    GRPO advantages are zero, and the step's metrics count them."""
    config = small_run_config(*SMALL, "sft.steps=0", "batching.equal_rewards=keep")
    with Experiment(config, cache_dir=cache) as exp:
        metrics = exp.step()
        batch = exp.last_batch["batch"]
        equal = [g for g in exp.last_batch["groups"] if np.all(g.rewards == g.rewards[0])]
    assert "dropped/filtered" not in metrics
    assert metrics["batch/equal_reward_groups"] == len(equal) > 0
    advantages = np.asarray(grpo_advantages(batch.rewards, batch.group_ids, batch.sequence_mask))
    rewards, group_ids = np.asarray(batch.rewards), np.asarray(batch.group_ids)
    real = np.asarray(batch.sequence_mask)
    flat = [g for g in set(group_ids[real]) if np.ptp(rewards[real & (group_ids == g)]) == 0]
    assert len(flat) == len(equal)
    assert np.all(advantages[np.isin(group_ids, flat)] == 0.0)


def test_last_batch_exposes_rollouts_and_ratios(cache):
    with Experiment(
        small_run_config(*SMALL),
        cache_dir=cache,
    ) as exp:
        metrics = exp.step()
        groups = exp.last_batch["groups"]
        assert len(groups) == exp.config.staleness.batch_size
        batch = exp.last_batch["batch"]
        assert batch.tokens.shape[0] >= 16 and np.isfinite(batch.behaviour_logprobs).all()
        assert {"train/loss", "train/ratio_mean", "train/clip_fraction"} <= set(metrics)
        report = exp.evaluate()
        assert 0.0 <= report.rows[0]["pass@k"] <= 1.0


def test_after_a_step_the_run_own_hooks_then_the_caller_hooks_run_when_due(cache, tmp_path):
    # step reads collect, collate, train, faults, push, hooks: the run's own (metrics,
    # trace, log, elastic fleet, checkpoint, collections) in order, then a caller's
    # every ``every`` steps, each seeing the step's metrics that step() returns.
    from rlaxkit.runtime import Hook, StepDone

    config = small_run_config(*SMALL, "checkpoint.every_steps=2")
    with Experiment(config, run_dir=tmp_path / "run", cache_dir=cache) as exp:
        names = [h.name for h in exp.hooks]
        assert names == ["metrics", "trace", "log", "elastic_fleet", "checkpoint", "collections"]
        seen: list[StepDone] = []
        hook = exp.add_hook(seen.append, every=2, name="every_other")
        assert isinstance(hook, Hook) and exp.hooks[-1] is hook
        returned = [exp.step() for _ in range(4)]
        assert [done.step for done in seen] == [2, 4]
        assert [done.metrics for done in seen] == [returned[1], returned[3]]
        assert seen[1].metrics is exp.history[-1] and seen[1].trainer_up
        assert len(seen[1].samples) == sum(len(g.rollouts) for g in seen[1].groups)
        assert {2, 4} <= exp.trainer.saved_steps()  # the checkpoint hook, as before
        exp.hooks.remove(hook)
        exp.step()
        assert len(seen) == 2
    with pytest.raises(ValueError, match="every must be an int >= 0"):
        Hook("evaluation", print, every=-1)
    assert not Hook("never", print, every=0).due(4)


def test_bad_config_fails_before_any_work():
    with pytest.raises(ValueError, match="sampling.n"):
        small_run_config(*SMALL, "sampling.n=1")
    with pytest.raises(ValueError, match=r"config\.runtime: unknown field\(s\) \['workers'\]"):
        small_run_config(*SMALL, "runtime.workers=3")
    with pytest.raises(ValueError, match="runtime.mode"):
        small_run_config(*SMALL, "runtime.mode=warp")


def test_reissued_prompts_need_no_admission_room(cache):
    """A preempted worker's prompts are still counted in flight, so they are issued
    again even when admission has no room for new ones (the same rule on every
    placement: the driver's ``issue``)."""
    # One decode step per round, so prompts stay in flight across rounds.
    with Experiment(small_run_config(*SMALL, "runtime.chunk_steps=1"), cache_dir=cache) as exp:
        exp.round()
        held = exp.fleet.in_flight()["worker-0"]
        assert held
        published = exp.parts.store.latest_version()
        exp.requeue(exp.fleet.preempt("worker-0"))
        in_flight = exp.buffer.in_flight
        capacity = exp.config.staleness.capacity(exp.buffer.accepted, in_flight, published)
        work = exp.issue({"worker-1": 1000}, published)
        issued = [item.issue.group_id for item in work["worker-1"]]
        assert issued[: len(held)] == sorted(held)  # the same ids, first
        assert len(issued) == len(held) + max(capacity, 0)
        assert exp.buffer.in_flight == in_flight + max(capacity, 0)


def test_run_trace_keeps_the_newest_events_in_memory_and_every_event_in_its_file(tmp_path):
    import threading

    from rlaxkit.rules.trace import read_trace
    from rlaxkit.runtime.common import RunTrace

    def fill(path, limit):
        trace = RunTrace(path, 0, threading.RLock(), {}, memory_limit=limit)
        for step in range(1, 301):
            trace.record(
                float(step), "train_step", "trainer", step, step=step, samples=4, duration_s=0.1
            )
        trace.discard_steps({299, 300})
        trace.close()
        return trace

    bounded = fill(tmp_path / "trace.jsonl", 100)
    steps = [e["step"] for e in bounded.memory]
    assert 100 <= len(steps) <= 125 and steps == list(range(301 - len(steps), 301))
    assert bounded.let_go + len(steps) == 300
    on_disk = read_trace(tmp_path / "trace.jsonl")
    assert [e["step"] for e in on_disk] == list(range(1, 301))
    assert [e["step"] for e in on_disk if e.discarded] == [299, 300]
    assert [e["step"] for e in bounded.memory if e.discarded] == [299, 300]
    # Without a file, memory is the only copy: every event stays.
    assert len(fill(None, 100).memory) == 300


def test_a_long_run_holds_neither_its_trained_rollouts_nor_its_whole_trace(cache, tmp_path):
    """A run without a fault plan keeps no trained group for a roll-back, and with a run
    directory only the newest ``runtime.trace_memory`` events stay in memory: what a
    process holds does not grow with the steps it has taken."""
    import gc

    from rlaxkit.data.rollout import Rollout
    from rlaxkit.rules.trace import read_trace

    config = small_run_config(*SMALL, "runtime.trace_memory=60")
    # Rollouts another test of this process left alive are not this run's: held here, so
    # that no new object takes one's id.
    gc.collect()
    before = [o for o in gc.get_objects() if isinstance(o, Rollout)]
    seen = {id(o) for o in before}
    with Experiment(config, run_dir=tmp_path / "run", cache_dir=cache) as exp:
        train, frozen = exp.trainer.train, []

        def train_and_look(*args):
            if len(frozen) == 2:
                gc.collect()  # a full collection: this step's end freezes
            frozen.append(gc.get_freeze_count())
            return train(*args)

        exp.trainer.train = train_and_look
        exp.run(6)
        assert frozen[0] == 0 and min(frozen[3:]) > 0  # frozen by step 3's end at the latest
        assert gc.get_freeze_count() == 0  # the run's end gives them back
        memory = len(exp.trace.memory)
        assert 60 <= memory <= 75 and exp.trace.let_go > 0
        assert exp.trace.let_go + memory == exp.trace.written
    assert len(read_trace(tmp_path / "run" / "trace.jsonl")) == exp.trace.written
    gc.collect()  # nothing is frozen now (the collector lists no frozen object)
    alive = sum(isinstance(o, Rollout) and id(o) not in seen for o in gc.get_objects())
    counts = exp.buffer.counts()
    # Rollouts still wanted: those of groups waiting or in flight, and the last batch.
    wanted = config.group_size * (
        counts["buffered"] + counts["in_flight"] + len(exp.last_batch["groups"])
    )
    assert counts["trained"] > len(exp.last_batch["groups"]) and alive <= wanted


def test_a_recorded_run_takes_a_fault_plan_and_keeps_nothing_on_disk(cache, tmp_path, monkeypatch):
    """``record_local_run(faults=...)``: the plan fires (a trainer restores from the
    checkpoints of a run directory of the recorder's own), and the directory is gone
    when the call returns."""
    import tempfile

    from rlaxkit.rules import FaultPlan
    from rlaxkit.runtime import record_local_run

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    plan = FaultPlan.from_dicts([{"kind": "preempt_trainer", "at_step": 3, "restart_after_s": 1}])
    config = small_run_config(*SMALL, "checkpoint.every_steps=2")
    # Every step a warm-up step: one run, whatever it compiles.
    events, runs = record_local_run(config, 5, warmup_steps=5, cache_dir=cache, faults=plan)
    assert runs == 1
    kinds = ("preemption", "restart")
    assert [e.kind for e in events if e.actor == "trainer" and e.kind in kinds] == list(kinds)
    assert [e["step"] for e in events if e.kind == "checkpoint_restore"] == [2]
    assert list(tmp_path.iterdir()) == []


def test_a_warm_start_published_twice_is_kept_once_and_whole(tiny_model, tmp_path):
    """Two processes that trained one warm start: the first copy renamed into place
    stays, the second is removed, and no half-written folder is left."""
    from rlaxkit.models import load_hf_checkpoint
    from rlaxkit.runtime.build import _publish

    path = tmp_path / "warm_start-abc"
    _publish(tiny_model, path)
    first = (path / "config.json").stat().st_mtime_ns
    _publish(tiny_model, path)
    assert [p.name for p in tmp_path.iterdir()] == ["warm_start-abc"]
    assert (path / "config.json").stat().st_mtime_ns == first
    loaded, _ = load_hf_checkpoint(path, with_tokenizer=False)
    assert loaded.config == tiny_model.config
