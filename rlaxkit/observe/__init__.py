"""What a run shows of itself: metrics files, trackers (TensorBoard, W&B, MLflow), the
figures of a run, Perfetto exports of its trace, and the drift attribution of its
importance ratios. Figures comparing runs are in ``comparisons``, the one style they
share in ``style``.

Names are imported on first use: importing one module of the package does not import
the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlaxkit.rules.surface import lazy_names

if TYPE_CHECKING:
    from rlaxkit.observe.comparisons import (
        compare_runs_figure,
        comparison_figure,
        curves_figure,
        overlay_figure,
        pass_at_k_figure,
        scaling_figure,
        trace_overlay_figure,
    )
    from rlaxkit.observe.drift import DriftProbe, drift_metrics
    from rlaxkit.observe.metrics import MetricsLogger, read_metrics
    from rlaxkit.observe.perfetto import PerfettoExport, export_perfetto
    from rlaxkit.observe.plotting import (
        audit_figure,
        drift_figure,
        drops_figure,
        plot_run,
        reward_figure,
        staleness_figure,
        throughput_figure,
        timeline_figure,
        update_figure,
    )
    from rlaxkit.observe.tracking import Tracker, TrackerName, Trackers, open_trackers

_MODULES = {
    "drift_metrics": "drift",
    "DriftProbe": "drift",
    "MetricsLogger": "metrics",
    "read_metrics": "metrics",
    "export_perfetto": "perfetto",
    "PerfettoExport": "perfetto",
    "audit_figure": "plotting",
    "compare_runs_figure": "comparisons",
    "comparison_figure": "comparisons",
    "curves_figure": "comparisons",
    "drift_figure": "plotting",
    "drops_figure": "plotting",
    "overlay_figure": "comparisons",
    "pass_at_k_figure": "comparisons",
    "plot_run": "plotting",
    "reward_figure": "plotting",
    "scaling_figure": "comparisons",
    "staleness_figure": "plotting",
    "throughput_figure": "plotting",
    "timeline_figure": "plotting",
    "trace_overlay_figure": "comparisons",
    "update_figure": "plotting",
    "open_trackers": "tracking",
    "Tracker": "tracking",
    "TrackerName": "tracking",
    "Trackers": "tracking",
}


__getattr__ = lazy_names(__name__, _MODULES, globals())


__all__ = [
    "audit_figure",
    "compare_runs_figure",
    "comparison_figure",
    "curves_figure",
    "drift_figure",
    "drift_metrics",
    "DriftProbe",
    "drops_figure",
    "export_perfetto",
    "MetricsLogger",
    "open_trackers",
    "overlay_figure",
    "pass_at_k_figure",
    "PerfettoExport",
    "plot_run",
    "read_metrics",
    "reward_figure",
    "scaling_figure",
    "staleness_figure",
    "throughput_figure",
    "timeline_figure",
    "trace_overlay_figure",
    "Tracker",
    "TrackerName",
    "Trackers",
    "update_figure",
]
