"""Small helpers below everything else: JAX utilities, the host-memory settings and run
folders' ownership.

Names are imported on first use: importing one module of the package does not import
the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlaxkit.rules.surface import lazy_names

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


__getattr__ = lazy_names(__name__, _MODULES, globals())


__all__ = [
    "claim_run_dir",
    "CompileCounter",
    "count_compilations",
    "host_arrays",
    "HostMemory",
    "run_status",
]
