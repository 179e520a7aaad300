"""A run's configuration: the config tree (``RunConfig`` and its parts), YAML and
``--set`` overrides, and the Ray backend's settings. Data only: building a run's parts
from it is the runtime's (``rlaxkit.runtime.build``).

Names are imported on first use: importing one module of the package does not import
the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlaxkit.rules.surface import lazy_names

if TYPE_CHECKING:
    from rlaxkit.config.io import (
        apply_overrides,
        convert,
        dump_yaml,
        from_dict,
        load_yaml,
        merge,
        read_yaml,
        to_dict,
        yaml_problem,
    )
    from rlaxkit.config.ray import (
        ActorResources,
        PlacementStrategy,
        RayConfig,
        WeightStoreKind,
        infeasible_requests,
        scheduled_workers,
        small_cluster_config,
    )
    from rlaxkit.config.run import (
        SMALL_RUN,
        AlgorithmSpec,
        DistillSpec,
        EvalConfig,
        MetricsConfig,
        ModelSpec,
        RunConfig,
        RuntimeConfig,
        TaskSpec,
        TrainerSpec,
        small_run_config,
    )

_MODULES = {
    "apply_overrides": "io",
    "convert": "io",
    "dump_yaml": "io",
    "from_dict": "io",
    "load_yaml": "io",
    "merge": "io",
    "read_yaml": "io",
    "to_dict": "io",
    "yaml_problem": "io",
    "ActorResources": "ray",
    "infeasible_requests": "ray",
    "PlacementStrategy": "ray",
    "RayConfig": "ray",
    "scheduled_workers": "ray",
    "small_cluster_config": "ray",
    "WeightStoreKind": "ray",
    "AlgorithmSpec": "run",
    "DistillSpec": "run",
    "EvalConfig": "run",
    "MetricsConfig": "run",
    "ModelSpec": "run",
    "RunConfig": "run",
    "RuntimeConfig": "run",
    "SMALL_RUN": "run",
    "small_run_config": "run",
    "TaskSpec": "run",
    "TrainerSpec": "run",
}


__getattr__ = lazy_names(__name__, _MODULES, globals())


__all__ = [
    "ActorResources",
    "AlgorithmSpec",
    "apply_overrides",
    "convert",
    "DistillSpec",
    "dump_yaml",
    "EvalConfig",
    "from_dict",
    "infeasible_requests",
    "load_yaml",
    "merge",
    "MetricsConfig",
    "ModelSpec",
    "PlacementStrategy",
    "RayConfig",
    "read_yaml",
    "RunConfig",
    "RuntimeConfig",
    "scheduled_workers",
    "small_cluster_config",
    "SMALL_RUN",
    "small_run_config",
    "TaskSpec",
    "to_dict",
    "TrainerSpec",
    "WeightStoreKind",
    "yaml_problem",
]
