"""Backends that run the loop: ``local`` (one process, the embedded default) and
``ray`` (the trainer, the parameter server and each worker as Ray actors).

``Experiment`` runs ``runtime.backend=local``; ``RayExperiment`` runs
``runtime.backend=ray`` and is imported on first use, so ``import rlaxkit.runtime``
does not import Ray (an optional extra: ``pip install -e ".[ray]"``).
"""

from rlaxkit.runtime.local import Experiment

__all__ = ["Experiment", "RayExperiment"]


def __getattr__(name: str):
    if name == "RayExperiment":
        try:
            from rlaxkit.runtime.ray_backend import RayExperiment
        except ModuleNotFoundError as error:
            if error.name != "ray":
                raise
            raise ImportError(
                'RayExperiment needs Ray: pip install -e ".[ray]" (or use runtime.backend=local)'
            ) from error
        return RayExperiment
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
