"""An inference worker: it pulls weights, generates with the inference engine, scores
its samples and hands back rollout groups; its samples behind one protocol
(``WorkerSamples``: single-turn samples, multi-turn episodes), and the replay log a
worker's generation is recovered from. The worker's host (``rlaxkit.worker.host``),
which the runtime drives, is not part of this surface.

Names are imported on first use: importing one module of the package does not import
the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlaxkit.rules.surface import lazy_names

if TYPE_CHECKING:
    from rlaxkit.worker.multi_turn import EpisodeTurns
    from rlaxkit.worker.replay_log import ReplayLog
    from rlaxkit.worker.samples import WorkerSamples, worker_samples
    from rlaxkit.worker.single_turn import VerifiedSamples
    from rlaxkit.worker.worker import InferenceWorker

_MODULES = {
    "EpisodeTurns": "multi_turn",
    "ReplayLog": "replay_log",
    "VerifiedSamples": "single_turn",
    "WorkerSamples": "samples",
    "worker_samples": "samples",
    "InferenceWorker": "worker",
}


__getattr__ = lazy_names(__name__, _MODULES, globals())


__all__ = [
    "EpisodeTurns",
    "InferenceWorker",
    "ReplayLog",
    "VerifiedSamples",
    "WorkerSamples",
    "worker_samples",
]
