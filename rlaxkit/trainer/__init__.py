"""The trainer: its configs (``config``), its state and optimizer (``state``), how both
lie on a mesh (``sharding``), the jitted train step (``step``), log-probs, supervised
warm starts, checkpoints, multi-process training and the distillation teacher. The
trainer's host (``rlaxkit.trainer.host``), which the runtime drives, is not part of this
surface.

Names are imported on first use: importing one module of the package does not import
the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlaxkit.rules.surface import lazy_names

if TYPE_CHECKING:
    from rlaxkit.trainer.checkpoint import (
        CheckpointDamaged,
        CheckpointManager,
        restore_train_state,
        save_train_state,
    )
    from rlaxkit.trainer.config import OptimizerConfig, TrainConfig
    from rlaxkit.trainer.distributed import DistributedConfig
    from rlaxkit.trainer.logprobs import (
        entropy_from_logits,
        logprobs_and_entropy,
        logprobs_from_logits,
        token_logprobs,
    )
    from rlaxkit.trainer.packed import PackedTrainStep
    from rlaxkit.trainer.prepared import PreparedBatch
    from rlaxkit.trainer.sft import SFTConfig, encode_demonstrations, supervised_warm_start
    from rlaxkit.trainer.sharding import make_mesh, shard_batch, shard_train_state
    from rlaxkit.trainer.state import TrainState, create_train_state, make_optimizer
    from rlaxkit.trainer.step import make_train_step

_MODULES = {
    "CheckpointDamaged": "checkpoint",
    "CheckpointManager": "checkpoint",
    "restore_train_state": "checkpoint",
    "save_train_state": "checkpoint",
    "DistributedConfig": "distributed",
    "entropy_from_logits": "logprobs",
    "logprobs_and_entropy": "logprobs",
    "logprobs_from_logits": "logprobs",
    "token_logprobs": "logprobs",
    "encode_demonstrations": "sft",
    "SFTConfig": "sft",
    "supervised_warm_start": "sft",
    "create_train_state": "state",
    "make_mesh": "sharding",
    "make_optimizer": "state",
    "make_train_step": "step",
    "OptimizerConfig": "config",
    "PackedTrainStep": "packed",
    "PreparedBatch": "prepared",
    "shard_batch": "sharding",
    "shard_train_state": "sharding",
    "TrainConfig": "config",
    "TrainState": "state",
}


__getattr__ = lazy_names(__name__, _MODULES, globals())


__all__ = [
    "CheckpointDamaged",
    "CheckpointManager",
    "create_train_state",
    "DistributedConfig",
    "encode_demonstrations",
    "entropy_from_logits",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "make_mesh",
    "make_optimizer",
    "make_train_step",
    "OptimizerConfig",
    "PackedTrainStep",
    "PreparedBatch",
    "restore_train_state",
    "save_train_state",
    "SFTConfig",
    "shard_batch",
    "shard_train_state",
    "supervised_warm_start",
    "token_logprobs",
    "TrainConfig",
    "TrainState",
]
