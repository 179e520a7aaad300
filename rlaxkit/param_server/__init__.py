"""Versioned weight stores: the trainer pushes, inference workers pull.

- :class:`ParameterServer`: the contract (``push``, ``pull``, ``latest_version``).
- :class:`InProcessParameterServer`: zero-copy, thread-safe; the local backend's default.
- :class:`TensorStoreParameterServer`: versioned zarr3 snapshots in a directory that any
  process can pull from, published atomically.
- :func:`tree_nbytes`: bytes of a pytree's arrays; :class:`TransferStats`: what moved.
"""

from rlaxkit.param_server.base import (
    EventHook,
    ParameterServer,
    TransferRecord,
    TransferStats,
    tree_nbytes,
)
from rlaxkit.param_server.local import InProcessParameterServer
from rlaxkit.param_server.tensorstore_store import TensorStoreParameterServer

__all__ = [
    "EventHook",
    "InProcessParameterServer",
    "ParameterServer",
    "TensorStoreParameterServer",
    "TransferRecord",
    "TransferStats",
    "tree_nbytes",
]
