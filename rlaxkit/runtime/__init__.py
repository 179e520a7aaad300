"""The run loop (``rlaxkit.runtime.driver.Experiment``) and the placements it drives:
``local`` (one process, the embedded default) and ``ray`` (the trainer, the parameter
server and each worker as Ray actors), picked by ``runtime.backend``.

Ray is imported only when a run asks for it, so ``import rlaxkit.runtime`` does not
import Ray (an optional extra: ``pip install -e ".[ray]"``). ``RayExperiment`` is the
same class as ``Experiment``: the backend comes from the config. ``record_local_run``
(a run's trace for the simulator to calibrate on or be compared with) is imported on
first use.
"""

from typing import TYPE_CHECKING

from rlaxkit.rules.surface import lazy_names
from rlaxkit.runtime.build import build_policy, build_task, warm_start
from rlaxkit.runtime.driver import Experiment
from rlaxkit.runtime.hooks import Hook, StepDone

if TYPE_CHECKING:
    from rlaxkit.runtime.record import record_local_run

RayExperiment = Experiment

__getattr__ = lazy_names(__name__, {"record_local_run": "record"}, globals())

__all__ = [
    "Experiment",
    "Hook",
    "RayExperiment",
    "StepDone",
    "build_policy",
    "build_task",
    "record_local_run",
    "warm_start",
]
