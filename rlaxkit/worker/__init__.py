"""An inference worker: it pulls weights, generates with the inference engine, scores
its samples and hands back rollout groups; single-turn samples and multi-turn episodes,
and the replay log a worker's generation is recovered from. The worker's host
(``rlaxkit.worker.host``), which the runtime drives, is not part of this surface.

Names are imported on first use: importing one module of the package does not import
the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlaxkit.worker.multi_turn import EpisodeTurns
    from rlaxkit.worker.replay_log import ReplayLog
    from rlaxkit.worker.single_turn import VerifiedSamples
    from rlaxkit.worker.worker import InferenceWorker

_MODULES = {
    "EpisodeTurns": "multi_turn",
    "ReplayLog": "replay_log",
    "VerifiedSamples": "single_turn",
    "InferenceWorker": "worker",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "EpisodeTurns",
    "InferenceWorker",
    "ReplayLog",
    "VerifiedSamples",
]
