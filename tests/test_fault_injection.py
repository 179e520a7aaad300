"""Fault injection in the local runtime: a random plan of worker and trainer preemptions
loses no accepted rollout; hung rewards and failed pulls are survived and counted."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from rlaxkit.config.run import small_run_config
from rlaxkit.observe.metrics import read_metrics
from rlaxkit.rules.fault_plan import Fault, FaultPlan, random_preemptions
from rlaxkit.rules.trace import drop_counts, read_trace, summarize
from rlaxkit.runtime import Experiment
from rlaxkit.tasks import RewardRunner, make_task
from rlaxkit.tasks.base import REWARD_TIMEOUT

STANDARD = Path(__file__).resolve().parents[1] / "configs" / "faults" / "standard.yaml"
SMALL = [
    "runtime.chunk_steps=2",
    "runtime.restart_s=2",
]


def learning(history):
    """A run's metrics without its wall-clock timings (fault counters included)."""
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "throughput/"))}
            for m in history]  # fmt: skip


def events(exp, kind, actor=None):
    return [
        e
        for e in exp.trace.memory.events
        if e.kind == kind and (actor is None or e.actor.startswith(actor))
    ]


def test_random_preemptions_lose_no_accepted_rollout(cache, tmp_path):
    # ~16 worker preemptions in the first 12 logical seconds (the run takes longer),
    # plus two trainer preemptions that roll back to the last checkpoint.
    workers = random_preemptions(
        targets=["worker-0", "worker-1"], horizon_s=12.0, mtbf_s=1.5, seed=0
    )
    trainer = FaultPlan(
        (
            Fault(kind="preempt_trainer", at_step=3, restart_after_s=2.0),
            Fault(kind="preempt_trainer", at_step=5),
        )
    )
    plan = workers.merged(trainer)
    assert len(workers) >= 10
    config = small_run_config(*SMALL, "steps=6", "checkpoint.every_steps=2")
    with Experiment(config, run_dir=tmp_path, cache_dir=cache, faults=plan) as exp:
        exp.run()
        exp.check_accounting()  # in flight, buffered, trained or dropped with a reason
        summary = exp.summary()
        assert exp.version == 6 and summary["accepted_lost"] == 0
        assert len(events(exp, "preemption", "worker")) >= 10
        assert len(events(exp, "preemption", "trainer")) == 2
        assert len(events(exp, "checkpoint_restore", "trainer")) == 2
        assert summary["lost_steps"] == 2  # steps 3 and 5, one past a checkpoint each
        # What was trained is exactly the groups of the surviving steps' batches.
        assert exp.buffer.counts()["trained"] == 6 * config.staleness.batch_size
        reissued = sum(e["reissued"] for e in events(exp, "preemption", "worker"))
        assert reissued > 0  # in-flight prompts were lost and generated again
        drops = drop_counts(exp.trace.memory.events)
        assert set(drops) <= {"filtered", "stale", "rolled_back"}
        assert events(exp, "run_end") == [] and summary["goodput"] > 0
    (end,) = events(exp, "run_end")
    assert 0 < end["goodput"] < 1


def test_hung_reward_failed_pulls_and_a_dead_parameter_server_are_counted(cache):
    plan = FaultPlan(
        (
            Fault(kind="hang_reward", at_s=1.0, count=2),
            Fault(kind="fail_pull", target="worker-0", at_step=1, count=2),
            # Early, so it heals inside the run: how many rounds three steps take
            # depends on the sampled rollouts, so on the CPU's float rounding (5 to 30
            # rounds over seeds 0-9 on one machine).
            Fault(kind="kill_param_server", at_s=2.0, restart_after_s=1.0),
            Fault(kind="slow_worker", target="worker-1", at_s=0.0, factor=3.0, duration_s=4.0),
        )
    )
    with Experiment(small_run_config(*SMALL, "steps=3"), cache_dir=cache, faults=plan) as exp:
        exp.run()
        exp.check_accounting()
        summary = exp.summary()
    assert summary["reward_failures"] == {REWARD_TIMEOUT: 2}
    assert summary["failed_pulls"] >= 2
    # A failed pull is a fault event of the worker that carries the error.
    failed = [e for e in events(exp, "fault", "worker") if "error" in e.fields]
    failed = [e for e in failed if e["fault"] == "fail_pull"]
    assert len(failed) == 2 and {e.actor for e in failed} == {"worker-0"}
    assert [e.actor for e in events(exp, "restart")] == ["param_server"]
    injected = {e["fault"] for e in events(exp, "fault")}
    assert {"hang_reward", "fail_pull", "kill_param_server", "slow_worker"} <= injected


def test_standard_plan_replays_identically(cache, tmp_path):
    plan = FaultPlan.load(STANDARD)
    assert {f.kind for f in plan} == {
        "slow_worker", "fail_pull", "preempt_worker", "hang_reward", "preempt_trainer",
        "preempt_slice", "kill_param_server",
    }  # fmt: skip
    runs = []
    for name in ("a", "b"):
        config = small_run_config(*SMALL, "steps=6", "checkpoint.every_steps=2")
        with Experiment(config, run_dir=tmp_path / name, cache_dir=cache, faults=plan) as exp:
            exp.run()
            exp.check_accounting()
            runs.append(learning(exp.history))
            assert exp.summary()["lost_steps"] == 1
    assert runs[0] == runs[1]


def test_pool_reward_really_hangs_and_times_out():
    task = make_task("arithmetic")
    problems = task.problems("test", 2)
    answers = [task.demonstration(p) for p in problems]
    with RewardRunner.for_task(task, "pool") as runner:
        runner.config = runner.config.__class__(mode="pool", num_workers=1, timeout_s=0.5)
        runner.inject_hang(1)
        first, second = runner.score(problems, answers)
    assert (first.score, first.reason) == (0.0, REWARD_TIMEOUT) and second.score == 1.0
    assert runner.counters[REWARD_TIMEOUT] == 1 and runner.counters["workers_replaced"] == 1


def test_bad_plans_fail_before_any_work(tmp_path):
    config = small_run_config(*SMALL)
    with pytest.raises(ValueError, match=r"faults\[0\]\.target: no worker named 'worker-9'"):
        Experiment(
            config, faults=FaultPlan((Fault(kind="preempt_worker", target="worker-9", at_s=1),))
        )
    with pytest.raises(ValueError, match="preempt_trainer restores the last checkpoint"):
        Experiment(config, faults=[{"kind": "preempt_trainer", "at_step": 1}])


def test_trainer_restore_drops_the_weights_of_the_discarded_branch(cache, tmp_path):
    """Checkpoint at 3, trainer lost after 5: workers hold version 4 of a branch the
    restored run never had. They drop it with their prompts and pull again (the new
    branch's weights), and the run goes on."""
    config = small_run_config(*SMALL, "steps=7", "checkpoint.every_steps=3")
    plan = [{"kind": "preempt_trainer", "at_step": 5, "restart_after_s": 1.0}]
    with Experiment(config, run_dir=tmp_path, cache_dir=cache, faults=plan) as exp:
        exp.run()
        exp.check_accounting()
        summary = exp.summary()
        (restore,) = events(exp, "checkpoint_restore")
        pulled = {e.actor for e in events(exp, "pull") if e.t > restore.t}
    assert restore["step"] == 3 and pulled == {"worker-0", "worker-1"}
    assert summary["steps"] == 7 and summary["lost_steps"] == 2
    assert summary["accepted_lost"] == 0
    # What the run reports holds each step once, as a resumed run leaves it: steps 4
    # and 5 of the discarded branch leave metrics.jsonl and the history, and their
    # train_step events stay in the trace marked discarded (readers skip them).
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert rows == json.loads(json.dumps(exp.history))
    steps = [e for e in read_trace(tmp_path / "trace.jsonl") if e.kind == "train_step"]
    assert [e["step"] for e in steps if e.discarded] == [4, 5]
    assert [e["step"] for e in steps if not e.discarded] == list(range(1, 8))
    assert summarize(steps).steps == 7
    assert summary["preemptions"] == {"worker": 0, "slice": 0, "trainer": 1, "param_server": 0}
    assert summary["restarts"] == {"trainer": 1} and rows[-1]["preemptions/trainer"] == 1


@pytest.mark.parametrize(
    ("settings", "outage", "stop_at", "held", "published", "pulled"),
    [
        # On-policy (η = 0): the workers must pull version 2 for step 3's batch. The
        # checkpoint of step 2 is taken while the outage holds step 2's push back.
        (("staleness.max_staleness=0",), {"at_step": 2, "restart_after_s": 3.0}, 2, {2}, 1, {2, 3}),
        # Pushes every 2 steps: the outage ends during step 3, which publishes the held
        # push; the checkpoint of step 3 must know that version 2 is the published one.
        (
            ("weight_sync.push_every_steps=2", "staleness.max_staleness=1"),
            {"at_step": 2, "restart_after_s": 1.0},
            3,
            set(),
            2,
            None,
        ),
        # An outage from the second round: step 1's push waits, and the checkpoint of
        # step 1 must not name version 1 as published.
        ((), {"at_s": 0.5, "restart_after_s": 4.0}, 1, {1}, 0, None),
    ],
    ids=["saved_while_held", "saved_after_it_was_published", "timed_outage"],
)
def test_a_push_an_outage_held_back_is_checkpointed_and_resumed(
    cache, tmp_path, settings, outage, stop_at, held, published, pulled
):
    """The parameter server goes down, so a step's push waits for it. A checkpoint taken
    while it waits holds it (the train state's own version, stored once) and names the
    version the workers could see as published; one taken after it was published names
    it. A run resumed from either goes on as the uninterrupted run does. (A LoRA run's
    held push: ``test_lora_publication``.)"""
    config = small_run_config(*SMALL, "steps=4", "checkpoint.every_steps=1", *settings)
    plan = [{"kind": "kill_param_server", **outage}]

    with Experiment(config, run_dir=tmp_path / "a", cache_dir=cache, faults=plan) as exp:
        exp.run()
        expected, expected_params = learning(exp.history), jax.device_get(exp.params())
    with Experiment(config, run_dir=tmp_path / "b", cache_dir=cache, faults=plan) as exp:
        exp.run(stop_at)
        assert set(exp.faults.held_weights()) == held and exp.published == published
    with Experiment(config, run_dir=tmp_path / "b", cache_dir=cache, faults=plan) as exp:
        assert exp.resumed_from == stop_at
        exp.run()
        exp.check_accounting()
        assert learning(exp.history) == expected
        assert exp.summary()["accepted_lost"] == 0
        if pulled is not None:
            assert {e.version for e in events(exp, "pull")} == pulled
        got = jax.device_get(exp.params())
    for a, b in zip(jax.tree.leaves(expected_params), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_worker_pull_path_is_built_in_its_declared_order():
    # connect (a fault plan's store, as this worker reaches it), then LoRA adapters,
    # then the sampler's dtype: each layer once, no probing of what the store can do.
    from rlaxkit.param_server import InProcessParameterServer
    from rlaxkit.param_server.adapters import AdapterParameterServer
    from rlaxkit.runtime.faulty_store import ParameterServerUnavailable, UnreliableParameterServer
    from rlaxkit.runtime.hosts import WeightStore
    from rlaxkit.worker.host import pull_path

    server = UnreliableParameterServer(lambda: InProcessParameterServer(keep=2))
    server.push(0, {"w": np.zeros(2, np.float32)})
    store = WeightStore(kind="inprocess", server=server)
    plain = pull_path(store, "worker-1", small_run_config())
    other = pull_path(store, "worker-0", small_run_config())
    server.failing["worker-1"] = 1
    with pytest.raises(ParameterServerUnavailable):
        plain.pull()  # this worker's pull fails, not the other's
    assert other.pull()[0] == 0 and plain.pull()[0] == 0
    assert store.connect() is server  # the trainer's client: the store itself
    lora = pull_path(store, "worker-1", small_run_config("trainer.lora.rank=2"))
    assert isinstance(lora.server, AdapterParameterServer)
