"""Versioned weight stores: the trainer pushes, inference workers pull.

- :class:`ParameterServer`: the contract (``push``, ``pull``, ``latest_version``).
- :class:`InProcessParameterServer`: zero-copy, thread-safe; the local backend's default.
- :class:`TensorStoreParameterServer`: versioned zarr3 snapshots in a directory that any
  process can pull from, published atomically.
- :class:`RayObjectStoreParameterServer` (``rlaxkit.param_server.ray_store``, extra
  ``ray``): the trainer puts each version in Ray's object store once; workers get it
  zero-copy on the same host. Imported on first use, so Ray stays optional.
- :class:`DeltaParameterServer` (``delta_store``): over any of them, pushes store and
  pulls read only the chunks that changed; :class:`ParamServerConfig` turns it on.
- :class:`AdapterParameterServer` (``adapters``): for LoRA runs, publishes the base
  weights once and then adapter versions, which pulls merge into the base.
- :func:`tree_nbytes`: bytes of a pytree's arrays; :class:`TransferStats`: what moved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlaxkit.param_server.base import (
    EventHook,
    ParameterServer,
    TransferRecord,
    TransferStats,
    tree_nbytes,
)
from rlaxkit.param_server.delta_store import DeltaParameterServer, ParamServerConfig
from rlaxkit.param_server.local import InProcessParameterServer
from rlaxkit.param_server.tensorstore_store import TensorStoreParameterServer

if TYPE_CHECKING:
    from rlaxkit.param_server.adapters import AdapterParameterServer
    from rlaxkit.param_server.ray_store import RayObjectStoreParameterServer

__all__ = [
    "AdapterParameterServer",
    "DeltaParameterServer",
    "EventHook",
    "InProcessParameterServer",
    "ParamServerConfig",
    "ParameterServer",
    "RayObjectStoreParameterServer",
    "TensorStoreParameterServer",
    "TransferRecord",
    "TransferStats",
    "tree_nbytes",
]


def __getattr__(name: str) -> type[AdapterParameterServer | RayObjectStoreParameterServer]:
    # Ray is an optional extra and slow to import, and the adapter store imports the
    # models (about a second): load each only when asked for.
    if name == "RayObjectStoreParameterServer":
        from rlaxkit.param_server.ray_store import RayObjectStoreParameterServer

        return RayObjectStoreParameterServer
    if name == "AdapterParameterServer":
        from rlaxkit.param_server.adapters import AdapterParameterServer

        return AdapterParameterServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
