"""The run loop (``rlaxkit.runtime.driver.Experiment``) and the placements it drives:
``local`` (one process, the embedded default) and ``ray`` (the trainer, the parameter
server and each worker as Ray actors), picked by ``runtime.backend``.

Ray is imported only when a run asks for it, so ``import rlaxkit.runtime`` does not
import Ray (an optional extra: ``pip install -e ".[ray]"``). ``RayExperiment`` is the
same class as ``Experiment``: the backend comes from the config.
"""

from rlaxkit.runtime.build import build_policy, build_task, warm_start
from rlaxkit.runtime.driver import Experiment

RayExperiment = Experiment

__all__ = ["Experiment", "RayExperiment", "build_policy", "build_task", "warm_start"]
