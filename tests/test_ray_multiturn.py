"""Multi-turn episodes on the Ray backend: worker actors run the calculator's episodes in
the deterministic mode (every tool step resolved before the next chunk, in order), so a
Ray run learns exactly as the local one and keeps its books."""

import pytest
from test_worker_multiturn import CONFIG, learning_metrics

from rlaxkit.config.run import RunConfig
from rlaxkit.runtime import Experiment

pytest.importorskip("ray")

from rlaxkit.config.ray import small_cluster_config  # noqa: E402
from rlaxkit.runtime import RayExperiment  # noqa: E402

pytestmark = pytest.mark.ray

STEPS = 2


def test_worker_actors_run_episodes_as_the_local_backend(ray_cluster, tmp_path):
    config = RunConfig.from_overrides([f"steps={STEPS}"], base=CONFIG)
    with Experiment(config, cache_dir=tmp_path) as exp:
        exp.run()
        local = learning_metrics(exp.history)
    ray_run = RunConfig.from_overrides(["runtime.backend=ray"], base=config)
    with RayExperiment(ray_run, cache_dir=tmp_path, ray_config=small_cluster_config()) as exp:
        exp.run()
        exp.check_accounting()
        rollouts = [r for g in exp.last_batch["groups"] for r in g.rollouts]
        history = exp.history
    assert any(not r.policy_mask.all() for r in rollouts)  # observations were trained on
    assert len(history) == len(local) == STEPS
    for step, (got, want) in enumerate(zip(learning_metrics(history), local, strict=True), 1):
        differ = {
            k: (got.get(k), want.get(k))
            for k in got.keys() | want.keys()
            if got.get(k) != want.get(k) and not k.startswith("fleet/")  # Ray's fleet size
        }
        assert not differ, f"step {step}: (ray, local) = {differ}"


def test_release_after_s_is_refused_up_front(ray_cluster, tmp_path):
    config = RunConfig.from_overrides(
        ["runtime.backend=ray", "episodes.release_after_s=1.0"], base=CONFIG
    )
    with pytest.raises(ValueError, match="release_after_s=1.0.*runtime.mode=concurrent"):
        RayExperiment(config, cache_dir=tmp_path, ray_config=small_cluster_config())
