"""The inference worker: pulls as the staleness policy says, fills its slots, emits scored
rollouts with per-token versions, gives back its prompts when preempted, and a worker
restored from a snapshot regenerates the in-flight prompts bit for bit."""

import json

import numpy as np
import pytest
from flax import nnx

from rlaxkit.inference import SamplingConfig
from rlaxkit.models import CharTokenizer, ModelConfig, Transformer
from rlaxkit.param_server import InProcessParameterServer
from rlaxkit.rules.controller import Issue
from rlaxkit.rules.policies import StalenessPolicy, WeightSyncPolicy
from rlaxkit.rules.trace import MemoryTrace
from rlaxkit.tasks import RewardRunner, make_task
from rlaxkit.worker.worker import InferenceWorker

TASK = make_task("arithmetic", max_digits=1)  # prompts like "3+5=", 4 characters
TOKENIZER = CharTokenizer(TASK.alphabet())
PROBLEMS = TASK.problems("train", 8)
# Two prompts of two samples fill the four rows; six tokens take three chunks of two.
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=6, n=2)
NUM_SLOTS, CHUNK_STEPS = 4, 2


@pytest.fixture(scope="module")
def weights():
    """The graph and two weight versions (different seeds) of a tiny character model."""
    config = ModelConfig(
        family="qwen3",
        vocab_size=TOKENIZER.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    graphdef, params0 = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    _, params1 = nnx.split(Transformer(config, rngs=nnx.Rngs(1)))
    return graphdef, {0: params0, 1: params1}


class Clock:
    """A clock that ticks one second per reading, so timings are reproducible."""

    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        self.now_s += 1.0
        return self.now_s


class FailingServer:
    """A parameter server that publishes version 0 and fails every pull."""

    def latest_version(self):
        return 0

    def pull(self):
        raise ConnectionError("store unreachable")


def make_worker(
    graphdef, server, *, pull_mode="in_flight", max_worker_lag=0, trace=None, inference=None
):
    return InferenceWorker(
        "worker-0",
        graphdef,
        SAMPLING,
        task=TASK,
        tokenizer=TOKENIZER,
        scorer=RewardRunner.for_task(TASK, "inline"),
        param_server=server,
        staleness=StalenessPolicy(batch_size=2, max_worker_lag=max_worker_lag),
        weight_sync=WeightSyncPolicy(pull_mode=pull_mode),
        trace=MemoryTrace() if trace is None else trace,
        clock=Clock(),
        num_slots=NUM_SLOTS,
        chunk_steps=CHUNK_STEPS,
        max_prompt_tokens=8,
        inference=inference,
    )


def issue(group_id: int) -> Issue:
    return Issue(group_id=group_id, problem_index=group_id % len(PROBLEMS), seed=100 + group_id)


def problem_for(item: Issue):
    return PROBLEMS[item.problem_index]


def run_until_idle(worker, limit=20):
    rollouts = []
    for _ in range(limit):
        if not worker.requests:
            return rollouts
        rollouts += worker.step()
    raise AssertionError(f"{worker.worker_id} still has prompts after {limit} chunks")


def assert_identical(rollouts, expected):
    """Same samples, tokens, log-probs and versions to the bit (finish times aside)."""
    assert [(r.group_id, r.sample_index) for r in rollouts] == [
        (r.group_id, r.sample_index) for r in expected
    ]
    for got, want in zip(rollouts, expected, strict=True):
        for name in ("prompt_tokens", "completion_tokens", "behaviour_logprobs", "versions"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
        assert (got.reward, got.finish_reason, got.reward_info) == (
            want.reward,
            want.finish_reason,
            want.reward_info,
        )
        assert got.timings["issued_s"] == want.timings["issued_s"]


def test_pulls_only_when_the_staleness_policy_says_so(weights):
    graphdef, params = weights
    server = InProcessParameterServer(keep=3)
    trace = MemoryTrace()
    worker = make_worker(graphdef, server, max_worker_lag=1, trace=trace)
    assert not worker.sync_weights()  # nothing published yet
    assert (worker.engine, worker.version, worker.free) == (None, None, 0)
    server.push(0, params[0])
    assert worker.sync_weights() and worker.version == 0
    server.push(1, params[1])
    assert not worker.sync_weights() and worker.version == 0  # one behind: within the lag
    server.push(2, params[0])
    assert worker.sync_weights() and worker.version == 2  # two behind: must pull
    assert [e.version for e in trace.events if e.kind == "pull"] == [0, 2]
    assert worker.engine.version == 2


def test_a_failed_pull_is_counted_and_traced(weights):
    trace = MemoryTrace()
    worker = make_worker(weights[0], FailingServer(), trace=trace)
    assert not worker.sync_weights() and not worker.sync_weights()
    assert worker.failed_pulls == 2 and worker.version is None
    assert [(e.kind, e["fault"]) for e in trace.events] == [("fault", "fail_pull")] * 2


def test_free_counts_prompts_of_n_samples_and_drains_before_a_between_requests_pull(weights):
    graphdef, params = weights
    server = InProcessParameterServer()
    server.push(0, params[0])
    worker = make_worker(graphdef, server, pull_mode="between_requests")
    worker.sync_weights()
    assert worker.free == NUM_SLOTS // SAMPLING.n == 2
    worker.submit(issue(0), PROBLEMS[0])
    assert worker.free == 1
    worker.step()
    server.push(1, params[1])
    assert not worker.sync_weights()  # a prompt is running: stop taking new ones
    assert worker.draining and worker.free == 0 and worker.version == 0
    rollouts = run_until_idle(worker)
    assert worker.sync_weights() and worker.version == 1
    assert not worker.draining and worker.free == 2
    # Every token of a between-requests rollout comes from one version.
    assert all(set(r.versions.tolist()) == {0} for r in rollouts)


def test_submit_and_step_until_done_yields_scored_rollouts_with_token_versions(weights):
    graphdef, params = weights
    server = InProcessParameterServer()
    server.push(0, params[0])
    trace = MemoryTrace()
    worker = make_worker(graphdef, server, trace=trace)
    worker.sync_weights()
    for group_id in (0, 1):
        worker.submit(issue(group_id), PROBLEMS[group_id])
    rollouts = worker.step()
    server.push(1, params[1])
    assert worker.sync_weights() and worker.version == 1  # in flight: at once
    rollouts += run_until_idle(worker)

    assert sorted((r.group_id, r.sample_index) for r in rollouts) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    for rollout in rollouts:
        length = len(rollout.completion_tokens)
        assert 1 <= length <= SAMPLING.max_new_tokens
        assert rollout.behaviour_logprobs.shape == rollout.versions.shape == (length,)
        assert np.all(rollout.behaviour_logprobs <= 0.0)
        assert np.all(np.diff(rollout.versions) >= 0)  # versions only move forward
        assert rollout.versions[0] == 0  # the first chunk ran on version 0
        assert rollout.reward in (0.0, 1.0) and rollout.worker_id == "worker-0"
        assert rollout.problem_id == PROBLEMS[rollout.group_id].id
        assert rollout.prompt_tokens.tolist() == TOKENIZER.encode(
            TASK.format_prompt(PROBLEMS[rollout.group_id])
        )
    assert any(r.first_version == 0 and r.last_version == 1 for r in rollouts)
    assert worker.generated_tokens == sum(r.num_tokens for r in rollouts)
    kinds = [e.kind for e in trace.events]
    assert kinds.count("generation_start") == kinds.count("generation_end") == 4
    assert kinds.count("decode") >= 2 and kinds.count("reward") >= 1
    assert not worker.requests and worker.free == 2


def test_launch_fetch_score_is_step_and_marks_a_pipelined_chunk(weights):
    graphdef, params = weights
    server = InProcessParameterServer()
    server.push(0, params[0])
    workers, traces = [], []
    for _ in range(2):
        traces.append(MemoryTrace())
        workers.append(make_worker(graphdef, server, trace=traces[-1]))
        workers[-1].sync_weights()
        workers[-1].submit(issue(0), PROBLEMS[0])
    stepped = run_until_idle(workers[0])
    split = []
    while workers[1].requests:
        workers[1].launch()
        split += workers[1].score(workers[1].fetch(pipelined=True))
    assert_identical(split, stepped)
    decodes = [e for e in traces[1].events if e.kind == "decode"]
    assert decodes and all(e["pipelined"] for e in decodes)
    assert workers[1].fetch() == []  # nothing launched


def test_preempt_returns_the_in_flight_issues_and_empties_the_worker(weights):
    graphdef, params = weights
    server = InProcessParameterServer()
    server.push(0, params[0])
    worker = make_worker(graphdef, server)
    worker.sync_weights()
    issues = [issue(3), issue(1)]
    for item in issues:
        worker.submit(item, problem_for(item))
    worker.step()
    assert worker.preempt() == issues
    assert not worker.requests and worker.engine is None and worker.version is None
    assert worker.free == 0 and worker.replay_weights() == {}
    assert (worker.snapshot()["base_version"], worker.snapshot()["ops"]) == (None, [])
    assert worker.sync_weights() and worker.free == 2  # back in service after a pull


@pytest.mark.parametrize("pull_mode", ["in_flight", "between_requests"])
def test_a_pull_in_flight_is_traced_with_the_rows_it_rebuilds(weights, pull_mode):
    graphdef, params = weights
    server, trace = InProcessParameterServer(), MemoryTrace()
    server.push(0, params[0])
    worker = make_worker(graphdef, server, pull_mode=pull_mode, trace=trace)
    worker.sync_weights()
    worker.submit(issue(0), PROBLEMS[0])
    worker.step()  # the group's rows are decoding
    server.push(1, params[1])
    pulled = worker.sync_weights()
    pulls = [e for e in trace.events if e.kind == "pull"]
    assert pulled == (pull_mode == "in_flight") and len(pulls) == 1 + pulled
    assert "rebuilt" not in pulls[0].fields  # the first pull: no engine yet
    if pulled:
        assert pulls[1]["rebuilt"] == SAMPLING.n  # the group's rows


@pytest.mark.parametrize("pull_mode", ["in_flight", "between_requests"])
def test_restored_worker_regenerates_its_prompts_bit_for_bit(weights, pull_mode):
    graphdef, params = weights
    server = InProcessParameterServer()
    server.push(0, params[0])
    worker = make_worker(graphdef, server, pull_mode=pull_mode)
    worker.sync_weights()
    worker.submit(issue(0), PROBLEMS[0])
    worker.step()
    worker.submit(issue(1), PROBLEMS[1])  # starts a chunk later than group 0
    server.push(1, params[1])
    worker.sync_weights()
    worker.step()

    saved = json.loads(json.dumps(worker.snapshot()))  # as a checkpoint stores it
    replay = worker.replay_weights()
    ops = [op[0] for op in saved["ops"]]
    assert saved["base_version"] == 0 and ops[:3] == ["s", "d", "s"]
    if pull_mode == "in_flight":
        assert ["u", 1, True] in saved["ops"] and sorted(replay) == [0, 1]
    else:
        assert saved["draining"] and sorted(replay) == [0]
    expected = run_until_idle(worker)
    assert len(expected) == 2 * SAMPLING.n  # both prompts were in flight

    restored = make_worker(graphdef, server, pull_mode=pull_mode)
    restored.restore(
        saved,
        issue_for=issue,
        problem_for=problem_for,
        weights_for=replay.__getitem__,
    )
    assert restored.snapshot() == saved
    assert sorted(restored.replay_weights()) == sorted(replay)
    assert_identical(run_until_idle(restored), expected)
    assert restored.generated_tokens == worker.generated_tokens


def test_restore_refuses_another_workers_snapshot(weights):
    server = InProcessParameterServer()
    snapshot = make_worker(weights[0], server).snapshot()
    snapshot["worker_id"] = "worker-1"
    with pytest.raises(ValueError, match="snapshot of worker-1 cannot restore worker-0"):
        make_worker(weights[0], server).restore(
            snapshot, issue_for=issue, problem_for=problem_for, weights_for={}.__getitem__
        )
