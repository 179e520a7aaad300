"""What flows from the workers to the trainer: rollouts and their groups, the buffer that
admits them by the staleness policy, and the bucketed batches the train step takes.

Names are imported on first use: importing one module of the package does not import
the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlaxkit.rules.surface import lazy_names

if TYPE_CHECKING:
    from rlaxkit.data.batch import BatchArray, BucketSpec, Sample, SampleLike, TrainBatch, collate
    from rlaxkit.data.buffer import RolloutBuffer
    from rlaxkit.data.rollout import ENVIRONMENT_VERSION, Rollout, RolloutGroup

_MODULES = {
    "BatchArray": "batch",
    "BucketSpec": "batch",
    "collate": "batch",
    "Sample": "batch",
    "SampleLike": "batch",
    "TrainBatch": "batch",
    "RolloutBuffer": "buffer",
    "ENVIRONMENT_VERSION": "rollout",
    "Rollout": "rollout",
    "RolloutGroup": "rollout",
}


__getattr__ = lazy_names(__name__, _MODULES, globals())


__all__ = [
    "BatchArray",
    "BucketSpec",
    "collate",
    "ENVIRONMENT_VERSION",
    "Rollout",
    "RolloutBuffer",
    "RolloutGroup",
    "Sample",
    "SampleLike",
    "TrainBatch",
]
