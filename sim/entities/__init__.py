"""The simulated fleet's entities, each a SimPy process or the state it keeps: the
buffer, the serial host that carries out a round, the fault injector, the parameter
server, the trainer, the verifier pool and the workers. ``sim.engine.Simulation`` holds
them; they see it, and one another, through the protocols of ``sim.entities.context``.

Names are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlaxkit.rules.surface import lazy_names

if TYPE_CHECKING:
    from sim.entities.buffer import SimBuffer
    from sim.entities.groups import SimSample
    from sim.entities.host import SerialHost
    from sim.entities.injector import FaultInjector
    from sim.entities.param_server import SimParameterServer
    from sim.entities.trainer import Trainer
    from sim.entities.verifier import VerifierPool
    from sim.entities.worker import SimWorker

_MODULES = {
    "SimBuffer": "buffer",
    "SimSample": "groups",
    "SerialHost": "host",
    "FaultInjector": "injector",
    "SimParameterServer": "param_server",
    "Trainer": "trainer",
    "VerifierPool": "verifier",
    "SimWorker": "worker",
}


__getattr__ = lazy_names(__name__, _MODULES, globals())


__all__ = [
    "FaultInjector",
    "SerialHost",
    "SimBuffer",
    "SimParameterServer",
    "SimSample",
    "SimWorker",
    "Trainer",
    "VerifierPool",
]
