"""Trackers: what TensorBoard, W&B (offline) and MLflow hold after a run, read back with
their own readers and compared with metrics.jsonl; a resumed run continues the same
tracker runs; a rewind hides TensorBoard's discarded steps, and W&B and MLflow, which
cannot un-log, get only the steps a checkpoint committed, each once."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

from rlaxkit.config.run import RunConfig, small_run_config
from rlaxkit.observe import tracking
from rlaxkit.observe.metrics import MetricsLogger, read_metrics
from rlaxkit.runtime import Experiment
from rlaxkit.runtime.state import config_differences

ALL = "tracking=[jsonl,tensorboard,wandb,mlflow]"
RUN = ["checkpoint.every_steps=2", "steps=5", "eval.num_problems=4", "eval.samples=2"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """W&B stays offline and MLflow uses the run directory's store: no server is asked."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)


# -- readers -----------------------------------------------------------------------------
def tensorboard_scalars(logdir):
    """{tag: {step: value}} as TensorBoard shows it (purged steps hidden)."""
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return events, {
        t: {e.step: e.value for e in events.Scalars(t)} for t in events.Tags()["scalars"]
    }


def wandb_records(run_file):
    """The records of an offline run's ``.wandb`` file: a LevelDB-style log of 32 KiB
    blocks, each record chunked behind a 7-byte header (crc32, length, type; type 1 a
    whole record, 2-4 its first, middle and last chunks), after the 7-byte file header."""
    data, block = Path(run_file).read_bytes(), 32768
    assert data[:4] == b":W&B"
    position, chunks, records = 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # too little room left for a header: padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == 0 and kind == 0:
            break
        chunks += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def wandb_history(records):
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or ".".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


# -- config-time errors --------------------------------------------------------------------
def test_unknown_tracker_names_the_field():
    with pytest.raises(ValueError, match=r"tracking\[1\]: must be one of"):
        RunConfig.from_overrides(["tracking=[jsonl,neptune]"])
    with pytest.raises(ValueError, match="tracking: unknown tracker 'neptune'"):
        RunConfig(tracking=("neptune",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tracking: \['wandb'\] named more than once"):
        RunConfig.from_overrides(["tracking=[wandb,wandb]"])


def test_a_missing_package_names_the_field_and_the_extra(monkeypatch):
    monkeypatch.setitem(tracking.REQUIREMENTS, "wandb", (("no_such_module_here",), "wandb"))
    with pytest.raises(
        ValueError, match=r"tracking: wandb needs no_such_module_here.*rlaxkit\[wandb\]"
    ):
        RunConfig.from_overrides(["tracking=[jsonl,wandb]"])


def test_external_trackers_need_a_run_dir():
    with pytest.raises(ValueError, match=r"tracking: \['tensorboard'\] write under the run dir"):
        Experiment(small_run_config("tracking=[tensorboard]"))  # fails before any work


def test_a_checkpoint_resumes_whatever_the_trackers():
    with_trackers = small_run_config(ALL).to_dict()
    before_tracking = small_run_config().to_dict()
    del before_tracking["tracking"]  # a checkpoint written before the setting existed
    assert config_differences(before_tracking, with_trackers) == []
    assert config_differences(small_run_config().to_dict(), with_trackers) == []


# -- a rewind ------------------------------------------------------------------------------
def test_tensorboard_hides_the_steps_after_a_rewind(tmp_path):
    board = tracking.TensorBoardTracker(tmp_path)
    for step in (1, 2, 3, 4):
        board.log_metrics(step, {"loss": float(step)})
    board.rewind(2)  # steps 3 and 4 are taken again
    for step in (3, 4, 5):
        board.log_metrics(step, {"loss": 10.0 * step})
    board.log_histogram(5, "staleness", {0: 3, 2: 1})
    board.close()
    events, scalars = tensorboard_scalars(tmp_path)
    assert scalars["loss"] == {1: 1.0, 2: 2.0, 3: 30.0, 4: 40.0, 5: 50.0}
    (histogram,) = events.Histograms("staleness")
    value = histogram.histogram_value
    # A bucket per integer from min to max: (-0.5, 0.5], (0.5, 1.5], (1.5, 2.5].
    assert (value.min, value.max, value.num, value.sum, value.sum_squares) == (0, 2, 4, 2, 4)
    assert list(value.bucket_limit) == [0.5, 1.5, 2.5] and list(value.bucket) == [3, 0, 1]


class Recorder:
    """A tracker that records its calls."""

    def __init__(self, forgets=True):
        self.forgets = forgets
        self.calls = []

    def log_metrics(self, step, metrics):
        self.calls.append(("metrics", step, dict(metrics)))

    def log_histogram(self, step, name, counts):
        self.calls.append(("histogram", step, name, dict(counts)))

    def log_config(self, config):
        self.calls.append(("config", dict(config)))

    def log_summary(self, summary):
        self.calls.append(("summary", dict(summary)))

    def rewind(self, step):
        self.calls.append(("rewind", step))

    def close(self, failed=False):
        self.calls.append(("close", failed) if failed else ("close",))


def test_trackers_fan_out_and_a_roll_back_rewrites_metrics_jsonl(tmp_path):
    recorder = Recorder()
    trackers = tracking.Trackers(
        MetricsLogger(tmp_path / "metrics.jsonl", progress=False), {"r": recorder}
    )
    for step in (1, 2, 3):
        trackers.log({"step": step, "loss": step / 2, "note": "x"}, {"staleness": [0, 1, 1]})
    trackers.roll_back(1, [{"step": 1, "loss": 0.5, "note": "x"}])
    trackers.log({"step": 2, "loss": 7.0}, {"staleness": [2]})
    trackers.log_eval(2, {"eval/pass_at_1": 0.25})
    trackers.log_summary({"steps": 2, "buffer": {"dropped": 1}})
    trackers.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": 0.5, "note": "x"},
        {"step": 2, "loss": 7.0},
    ]
    assert recorder.calls[:2] == [
        ("metrics", 1, {"step": 1.0, "loss": 0.5}),  # numbers only
        ("histogram", 1, "staleness", {0: 1, 1: 2}),
    ]
    assert recorder.calls[6:] == [
        ("rewind", 1),
        ("metrics", 2, {"step": 2.0, "loss": 7.0}),
        ("histogram", 2, "staleness", {2: 1}),
        ("metrics", 2, {"eval/pass_at_1": 0.25}),  # not in metrics.jsonl
        ("summary", {"steps": 2, "buffer": {"dropped": 1}}),
        ("close",),
    ]


def test_trackers_that_cannot_forget_get_committed_steps_once(tmp_path):
    """TensorBoard (forgets) gets every step at once and the rewind; MLflow and W&B (do
    not) get a step once a checkpoint commits it, so step 3, taken twice, shows once."""
    board, store = Recorder(forgets=True), Recorder(forgets=False)
    trackers = tracking.Trackers(
        MetricsLogger(tmp_path / "metrics.jsonl", progress=False),
        {"tensorboard": board, "mlflow": store},
        hold=True,
    )
    for step in (1, 2, 3):
        trackers.log({"step": step, "loss": float(step)})
        if step == 2:
            trackers.commit(2)  # the checkpoint of step 2
    assert [c[1] for c in store.calls] == [1, 2]
    trackers.roll_back(2, [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}])
    trackers.log({"step": 3, "loss": 9.0})  # step 3 again, kept this time
    trackers.log_eval(3, {"eval/pass_at_1": 0.5})
    trackers.close(finished=True)
    assert [c[1] for c in board.calls if c[0] == "metrics"] == [1, 2, 3, 3, 3]
    assert store.calls == [
        ("metrics", 1, {"step": 1.0, "loss": 1.0}),
        ("metrics", 2, {"step": 2.0, "loss": 2.0}),
        ("rewind", 2),
        ("metrics", 3, {"step": 3.0, "loss": 9.0}),
        ("metrics", 3, {"eval/pass_at_1": 0.5}),
        ("close",),
    ]


def test_a_crashed_run_gives_no_uncommitted_step_and_is_marked_failed(tmp_path):
    store = Recorder(forgets=False)
    trackers = tracking.Trackers(
        MetricsLogger(tmp_path / "metrics.jsonl", progress=False),
        {"mlflow": store},
        hold=True,
        committed=1,  # resumed from the checkpoint of step 1
    )
    trackers.log({"step": 2, "loss": 2.0})  # a resume does it again
    trackers.close(finished=False, failed=True)
    assert store.calls == [("close", True)]
    mlflow = tracking.MlflowTracker(tmp_path, None, "crashed")
    mlflow.close(failed=True)
    assert MlflowClient(mlflow.tracking_uri).get_run(mlflow.run_id).info.status == "FAILED"


# -- a run, stopped and resumed ----------------------------------------------------------
@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """A run with every tracker stopped after step 3 (its checkpoint: step 2) and resumed
    to step 5: step 3 is taken twice."""
    root = tmp_path_factory.mktemp("tracking")
    run, config = root / "run", small_run_config(*RUN, ALL)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        patch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
        with Experiment(config, run_dir=run, cache_dir=root / "cache") as exp:
            stopped = [exp.step() for _ in range(3)]
        ids = json.loads((run / "tracking.json").read_text())
        with Experiment(config, run_dir=run, cache_dir=root / "cache") as exp:
            assert exp.resumed_from == 2
            exp.run()
            lost_steps = exp.books.lost_steps
            pass_at_1 = exp.evaluate().rows[0]["pass@k"]
    return {
        "run": run,
        "stopped": stopped,
        "ids": ids,
        "lost_steps": lost_steps,
        "pass_at_1": pass_at_1,
    }


def test_resumed_run_continues_the_same_tracker_runs(resumed_run):
    run, ids = resumed_run["run"], resumed_run["ids"]
    assert json.loads((run / "tracking.json").read_text()) == ids
    offline_runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2 and all(p.name.endswith(ids["wandb"]) for p in offline_runs)
    (experiment,) = [
        e
        for e in MlflowClient(f"sqlite:///{run}/mlflow.db").search_experiments()
        if e.name == "rlaxkit"
    ]
    runs = MlflowClient(f"sqlite:///{run}/mlflow.db").search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]]
    assert runs[0].info.status == "FINISHED"


def test_tensorboard_holds_metrics_jsonl(resumed_run):
    run = resumed_run["run"]
    rows = read_metrics(run / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    events, scalars = tensorboard_scalars(run / "tensorboard")
    for row in rows:  # the stopped run's step 3 is hidden: its wall times differ
        for key, value in row.items():
            if isinstance(value, int | float):
                assert scalars[key][row["step"]] == np.float32(value), (key, row["step"])
    assert all(set(scalars[k]) == {1, 2, 3, 4, 5} for k in rows[0])
    staleness = events.Histograms("staleness")
    assert [h.step for h in staleness] == [1, 2, 3, 4, 5]
    assert all(h.histogram_value.num == 4 for h in staleness)  # staleness.batch_size groups
    assert scalars["eval/pass_at_1"] == {5: np.float32(resumed_run["pass_at_1"])}
    assert scalars["summary/steps"] == {5: 5.0}
    assert scalars["summary/lost_steps"] == {5: float(resumed_run["lost_steps"])}
    configs = events.Tensors("config/text_summary")  # at step 0, once per session
    assert len(configs) == 2 and "batch_size: 4" in configs[-1].tensor_proto.string_val[0].decode()


def test_wandb_offline_run_holds_metrics_jsonl(resumed_run):
    run = resumed_run["run"]
    rows = read_metrics(run / "metrics.jsonl")
    sessions = [
        wandb_records(next(p.glob("run-*.wandb")))
        for p in sorted((run / "wandb").glob("offline-run-*"))
    ]
    first, second = (wandb_history(records) for records in sessions)
    metrics = [h for h in first + second if "reward/mean" in h]
    # Step 3 once: the stopped run's was past its checkpoint (step 2), so W&B, which
    # cannot un-log, never got it; the resumed run's is the one kept.
    assert [h["step"] for h in metrics] == [1, 2, 3, 4, 5]
    assert [h["step"] for h in first if "reward/mean" in h] == [1, 2]
    kept = {h["step"]: h for h in metrics}
    for row in rows:
        for key, value in row.items():
            if isinstance(value, int | float):
                assert kept[row["step"]][key] == value, (key, row["step"])
    assert kept[3]["time/train_s"] != resumed_run["stopped"][2]["time/train_s"]
    (evaluation,) = [h for h in second if "eval/pass_at_1" in h]
    assert evaluation["step"] == 5 and evaluation["eval/pass_at_1"] == resumed_run["pass_at_1"]
    histograms = [h for h in first + second if "staleness._type" in h]
    assert [h["step"] for h in histograms] == [1, 2, 3, 4, 5]
    assert all(sum(h["staleness.values"]) == 4 for h in histograms)
    config = {
        item.key: json.loads(item.value_json)
        for record in sessions[0]
        if record.WhichOneof("record_type") == "config"
        for item in record.config.update
    }
    assert config["staleness"]["batch_size"] == 4 and config["steps"] == 5
    summary = {
        item.key or ".".join(item.nested_key): json.loads(item.value_json)
        for record in sessions[1]
        if record.WhichOneof("record_type") == "summary"
        for item in record.summary.update
    }
    assert summary["steps"] == 5 and summary["lost_steps"] == resumed_run["lost_steps"]
    assert summary["buffer/dropped_by_reason/filtered"] == rows[-1]["dropped/filtered"]


def test_mlflow_store_holds_metrics_jsonl(resumed_run):
    run, run_id = resumed_run["run"], resumed_run["ids"]["mlflow"]
    rows = read_metrics(run / "metrics.jsonl")
    client = MlflowClient(f"sqlite:///{run}/mlflow.db")
    history = client.get_metric_history(run_id, "reward/mean")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]  # each step once
    for key in ("reward/mean", "staleness/mean", "time/train_s", "buffer/dropped"):
        points = client.get_metric_history(run_id, key)
        assert sorted(m.step for m in points) == [1, 2, 3, 4, 5], key
        assert {m.step: m.value for m in points} == {row["step"]: row[key] for row in rows}, key
    (evaluation,) = client.get_metric_history(run_id, "eval/pass_at_1")
    assert (evaluation.step, evaluation.value) == (5, resumed_run["pass_at_1"])
    data = client.get_run(run_id).data
    assert data.params["staleness.batch_size"] == "4"
    assert data.params["tracking"] == "['jsonl', 'tensorboard', 'wandb', 'mlflow']"
    assert data.metrics["summary/steps"] == 5
    assert data.metrics["summary/lost_steps"] == resumed_run["lost_steps"]
    counts = {k: v for k, v in data.metrics.items() if k.startswith("staleness/count/")}
    assert sum(counts.values()) == 4  # the last step's histogram: its 4 groups
    assert data.metrics["summary/buffer/dropped_by_reason/filtered"] == rows[-1]["dropped/filtered"]
