"""Drift attribution: the log-ratio split into staleness and engine mismatch."""

import numpy as np
import pytest
from flax import nnx

from rlaxkit.algorithms import algorithm
from rlaxkit.config.run import small_run_config
from rlaxkit.data.batch import BucketSpec, Sample, collate
from rlaxkit.models import ModelConfig, Transformer
from rlaxkit.observe.drift import DriftProbe, drift_metrics
from rlaxkit.param_server import InProcessParameterServer
from rlaxkit.runtime import Experiment
from rlaxkit.trainer.config import OptimizerConfig, TrainConfig
from rlaxkit.trainer.state import create_train_state
from rlaxkit.trainer.step import make_train_step

CONFIG = ModelConfig(
    family="qwen3",
    vocab_size=24,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
)
BUCKET = BucketSpec(lengths=(16,), batch_sizes=(8,))
SMALL = ("eval.num_problems=4", "eval.samples=1", "metrics.drift_every=1")


def test_drift_metrics_match_hand_derived_values():
    # Two tokens: staleness d = (log 0.5 - log 0.25, 0) = (ln 2, 0); mismatch d = (0, 0).
    # |d| mean = ln 2 / 2 = 0.3466; k3 = ((2 - 1) - ln 2) / 2 = 0.1534; ratio 2 is past
    # 1.2 (clipped) and not past the cap 2 (not masked); by lag: lag 1 holds ln 2.
    theta, version, behaviour = np.log([[0.5, 0.5]]), np.log([[0.25, 0.5]]), np.log([[0.25, 0.5]])
    out = drift_metrics(
        theta,
        version,
        behaviour,
        np.ones((1, 2)),
        clip_low=0.2,
        clip_high=0.2,
        cap=2.0,
        lag=np.array([[1, 0]]),
    )
    assert out["drift/staleness/abs_mean"] == pytest.approx(np.log(2) / 2)
    assert out["drift/staleness/k3"] == pytest.approx((1 - np.log(2)) / 2)
    assert out["drift/staleness/clipped_share"] == 0.5
    assert out["drift/staleness/masked_share"] == 0.0
    assert out["drift/staleness/lag_1"] == pytest.approx(np.log(2))
    assert out["drift/staleness/lag_0"] == 0.0
    assert out["drift/mismatch/abs_mean"] == out["drift/mismatch/k3"] == 0.0
    # A masked-out token counts nowhere, however far off.
    far = drift_metrics(
        theta,
        version,
        np.array([[-200.0, np.log(0.5)]]),
        np.array([[0.0, 1.0]]),
        clip_low=0.2,
        clip_high=0.2,
        cap=2.0,
    )
    assert far["drift/tokens"] == 1.0 and far["drift/mismatch/abs_mean"] == 0.0


def _samples(versions, probe, trees, seed=0):
    """Rows sampled (exactly: the trainer's log-probs) by the given weight versions."""
    rng = np.random.RandomState(seed)
    samples = []
    for i, v in enumerate(versions):
        prompt = rng.randint(1, 24, 3).tolist()
        completion = rng.randint(1, 24, 6).tolist()
        tokens = np.array([prompt + completion])
        logp = np.asarray(probe.logprobs(trees[v], tokens, np.ones_like(tokens, bool)))[0, 3:]
        samples.append(
            Sample(
                prompt_tokens=prompt,
                completion_tokens=completion,
                behaviour_logprobs=logp.tolist(),
                versions=v,
                reward=float(i % 2),
                group_id=i // 2,
            )
        )
    return samples


def test_staleness_grows_with_lag_and_an_evicted_version_is_skipped_and_counted():
    graphdef, params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
    cfg = TrainConfig(
        algorithm=algorithm("grpo", loss={"kl_coef": 0.0}),
        optimizer=OptimizerConfig(learning_rate=3e-3, weight_decay=0.0),
    )
    step = make_train_step(cfg, graphdef, keep_params=True)
    state = create_train_state(cfg, params)
    store = InProcessParameterServer(keep=4)
    probe = DriftProbe(cfg, graphdef, every=1, reader=store)
    store.push(0, state.params)
    trees = {0: state.params}
    train_batch = collate(_samples([0] * 8, probe, trees, seed=1), bucket=BUCKET)
    for version in range(1, 4):  # the same batch again: the weights keep moving one way
        state, _ = step(state, train_batch)
        store.push(version, state.params)
        trees[version] = state.params
    # Rows sampled by versions 0-3, trained at version 3: lags 3, 2, 1, 0.
    batch = collate(_samples([0, 0, 1, 1, 2, 2, 3, 3], probe, trees), bucket=BUCKET)
    out = probe(state.params, batch, 3)
    lags = [out[f"drift/staleness/lag_{k}"] for k in range(4)]
    assert lags[0] == 0.0 and 0 < lags[1] < lags[2] < lags[3], lags
    assert out["drift/mismatch/abs_mean"] < 1e-5  # an exact sampler
    assert out["drift/skipped_batches"] == 0.0
    store.push(4, state.params)  # keep=4: version 0 is evicted
    skipped = probe(state.params, batch, 3)
    assert skipped == {"drift/skipped_batches": 1.0}
    assert probe.due(5) and not DriftProbe(cfg, graphdef, every=0, reader=store).due(5)


def _drift_rows(cache, *overrides, steps):
    with Experiment(small_run_config(*SMALL, *overrides), cache_dir=cache) as exp:
        history = exp.run(steps)
        audit = exp.summary()["audit"]
    assert audit["passed"], audit  # the sampled data is the trained data
    assert all("audit/length_ks" in m for m in history)
    return [m for m in history if "drift/tokens" in m]


def test_an_exact_sampler_on_policy_shows_no_drift(cache):
    rows = _drift_rows(cache, "staleness.max_staleness=0", steps=2)
    assert len(rows) == 2
    for m in rows:
        assert m["drift/staleness/abs_mean"] == 0.0
        assert m["drift/mismatch/abs_mean"] < 1e-5
        assert m["drift/mismatch/clipped_share"] == 0.0


def test_a_bfloat16_sampler_shows_mismatch_and_no_staleness(cache):
    rows = _drift_rows(cache, "staleness.max_staleness=0", "model.sampler_dtype=bfloat16", steps=2)
    assert len(rows) == 2
    for m in rows:
        assert m["drift/staleness/abs_mean"] == 0.0
        assert m["drift/mismatch/abs_mean"] > 1e-4  # bfloat16 keeps 8 bits of mantissa
        assert m["drift/mismatch/k3"] >= 0.0


def test_drift_and_audit_figures_draw_a_run_of_attributed_steps(tmp_path):
    from rlaxkit.observe.metrics import MetricsLogger
    from rlaxkit.observe.plotting import plot_run

    logger = MetricsLogger(tmp_path / "metrics.jsonl", progress=False)
    for step in range(1, 5):
        row = {"step": step, "reward/mean": 0.5, "audit/length_ks": 0.0}
        row |= {
            f"audit/{n}_{w}_mean": 1.0
            for n in ("length", "pass_rate")
            for w in ("sampled", "trained")
        }
        if step % 2 == 0:  # drift_every=2
            row |= {"drift/tokens": 10.0}
            row |= {
                f"drift/{p}/{k}": 0.01 * step
                for p in ("staleness", "mismatch")
                for k in ("abs_mean", "k3")
            }
        logger.log(row)
    logger.close()
    names = sorted(p.name for p in plot_run(tmp_path, figures=("drift", "audit")))
    assert names == ["audit.png", "drift.png"]


@pytest.mark.parametrize(
    "options",
    [
        {"micro_batches": 2, "shuffle": True},  # one update: its own forward pass
        {"mini_batches": 2, "proximal": "recompute"},  # the recomputed proximal log-probs
        {"mini_batches": 2},  # neither: the probe's own forward pass, before the step
    ],
)
def test_the_step_hands_the_attribution_log_pi_theta_under_the_weights_it_starts_from(options):
    graphdef, params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
    options = dict(options)
    proximal = options.pop("proximal", "behaviour")
    from_step = options.get("mini_batches", 1) == 1 or proximal == "recompute"
    cfg = TrainConfig(
        algorithm=algorithm("grpo", loss={"kl_coef": 0.0, "proximal": proximal}),
        optimizer=OptimizerConfig(learning_rate=3e-3, weight_decay=0.0),
        drift_every=1,
        **options,
    )
    step = make_train_step(cfg, graphdef, keep_params=True)
    assert step.step_logprobs == from_step
    state = create_train_state(cfg, params)
    store = InProcessParameterServer(keep=4)
    step.drift.reader = store
    store.push(0, state.params)
    batch = collate(_samples([0] * 8, step.drift, {0: state.params}, seed=2), bucket=BUCKET)
    before = np.asarray(step.drift.logprobs(state.params, batch.tokens, batch.attention_mask))
    seen = {}
    step.drift.attribute = lambda p, b, v, log_theta=None: seen.update(log_theta=log_theta) or {}
    new_state, _ = step(state, batch)
    assert int(new_state.step) == 1
    if step.step_logprobs:  # the pre-update weights' log-probs, row for row
        np.testing.assert_allclose(np.asarray(seen["log_theta"]), before, atol=2e-6)
    else:
        assert seen["log_theta"] is None
