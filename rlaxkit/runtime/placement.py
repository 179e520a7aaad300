"""Where a run's parts live: ``runtime.backend`` picks the placement the driver drives.

``start_placement`` builds the task, tokenizer and model graph, and the placement's
fleet, trainer client and parameter-server client (``Parts``, typed in
``rlaxkit.runtime.parts`` beside the protocols the loop is handed through). The local
placement (``rlaxkit.runtime.local``) keeps everything in this process; the Ray placement
(``rlaxkit.runtime.ray_placement``) starts actors, and is imported only when asked for,
so ``import rlaxkit.runtime`` does not import Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlaxkit.config.run import RunConfig

if TYPE_CHECKING:
    from rlaxkit.rules.books import RunBooks
    from rlaxkit.runtime.common import RunTrace
    from rlaxkit.runtime.faults import NoFaults
    from rlaxkit.runtime.parts import Parts


def start_placement(
    config: RunConfig,
    *,
    trace: RunTrace,
    clock: Callable[[], float],
    books: RunBooks,
    faults: NoFaults,
    run_dir: Path | None,
    cache_dir: Path | None,
    ray_config: Any = None,
    worker_ids: list[str] | None = None,
) -> Parts:
    """The parts of ``config.runtime.backend``'s placement, started (``worker_ids``: the
    fleet a resumed run saved)."""
    backend = config.runtime.backend
    if backend == "local":
        # Imported when used, as Ray's: ``import rlaxkit.runtime`` loads no placement's
        # hosts (the trainer's and the workers').
        from rlaxkit.runtime.local import start_local

        return start_local(config, trace, clock, books, faults, run_dir, cache_dir)
    if backend == "ray":
        try:
            from rlaxkit.runtime.ray_placement import start_ray
        except ModuleNotFoundError as error:
            if error.name != "ray":
                raise
            raise ImportError(
                'runtime.backend=ray needs Ray: pip install -e ".[ray]" (or use '
                "runtime.backend=local)"
            ) from error
        return start_ray(config, trace, clock, books, run_dir, cache_dir, ray_config, worker_ids)
    raise ValueError(f"runtime.backend: {backend!r} is not one of ('local', 'ray')")
