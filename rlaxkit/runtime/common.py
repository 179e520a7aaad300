"""What the local and Ray backends share: the train-batch buckets and step metrics."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlaxkit.batch import BucketSpec
from rlaxkit.rollout import Rollout, RolloutGroup

# Sequence lengths a train batch is padded to: one step program per length seen.
TRAIN_BUCKETS = BucketSpec(lengths=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096))


def batch_metrics(
    version: int,
    groups: Sequence[RolloutGroup],
    samples: Sequence[Rollout],
    buffer_counts: Mapping[str, Any],
    train_metrics: Mapping[str, float],
) -> dict[str, Any]:
    """The learning metrics of the step that produced weight ``version``.

    Staleness of a group is ``version - 1 - first_version`` (the trainer was at
    ``version - 1`` when it took the batch). Keys: ``step``, ``reward/*``,
    ``staleness/*``, ``completion/mean_tokens``, ``buffer/*``, ``dropped/<reason>``
    and ``train/<metric>``; wall-clock keys are the caller's.
    """
    rewards = np.array([s.reward for s in samples])
    staleness = np.array([version - 1 - g.first_version for g in groups])
    correct = np.array([s.reward_info["correct"] for s in samples])
    return {
        "step": version,
        "reward/mean": float(rewards.mean()),
        "reward/pass_rate": float(correct.mean()),
        "staleness/mean": float(staleness.mean()),
        "staleness/max": int(staleness.max()),
        "completion/mean_tokens": float(np.mean([s.num_tokens for s in samples])),
        "buffer/in_flight": buffer_counts["in_flight"],
        "buffer/buffered": buffer_counts["buffered"],
        "buffer/trained": buffer_counts["trained"],
        "buffer/dropped": buffer_counts["dropped"],
        **{f"dropped/{k}": v for k, v in buffer_counts["dropped_by_reason"].items()},
        **{f"train/{k}": v for k, v in train_metrics.items()},
    }
