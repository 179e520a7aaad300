"""Small helpers below everything else: JAX utilities, the host-memory settings and run
folders' ownership.

Names are imported on first use: importing one module of the package does not import
the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlaxkit.util.hostmem import HostMemory
    from rlaxkit.util.jaxutil import CompileCounter, count_compilations, host_arrays
    from rlaxkit.util.rundirs import claim_run_dir, run_status

_MODULES = {
    "HostMemory": "hostmem",
    "CompileCounter": "jaxutil",
    "count_compilations": "jaxutil",
    "host_arrays": "jaxutil",
    "claim_run_dir": "rundirs",
    "run_status": "rundirs",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "claim_run_dir",
    "CompileCounter",
    "count_compilations",
    "host_arrays",
    "HostMemory",
    "run_status",
]
