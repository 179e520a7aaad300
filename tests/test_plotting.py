"""``rlaxkit plot RUN_DIR`` writes PNGs of the expected size; every figure draws."""

import json
import struct

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.patches import StepPatch

import sim
from rlaxkit import observe
from rlaxkit.cli import main
from rlaxkit.config.run import small_run_config
from rlaxkit.observe import style
from rlaxkit.observe.metrics import MetricsLogger
from rlaxkit.observe.perfetto import validate
from rlaxkit.rules.trace import JsonlTraceWriter, MemoryTrace
from rlaxkit.runtime import Experiment

WIDTH, HEIGHT = (round(s * style.DPI) for s in style.SIZE_IN)  # 700 x 400
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (the first chunk, right after the signature)."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


TRACE_PLOTS = ["staleness.png", "timeline.png", "throughput.png", "drops.png"]


def check_plots(run_dir, capsys, expected):
    assert main(["plot", str(run_dir)]) == 0
    printed = capsys.readouterr().out.split()
    names = sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    assert names == sorted(expected)
    assert sorted(p.rsplit("/", 1)[-1] for p in printed) == names
    for name in names:
        path = run_dir / "plots" / name
        assert path.stat().st_size > 1000, name  # a real image, not an empty canvas
        assert png_size(path) == (WIDTH, HEIGHT), name


def test_plot_writes_png_files_of_the_expected_size_for_a_simulated_run(tmp_path, capsys):
    # A run directory in the shared format, written by the simulator and a metrics log.
    with JsonlTraceWriter(tmp_path / "trace.jsonl") as trace:
        result = sim.simulate(sim.presets.toy(target_steps=4), trace=trace)
    logger = MetricsLogger(tmp_path / "metrics.jsonl", progress=False)
    for step in range(1, result.steps + 1):
        logger.log({"step": step, "reward/mean": 0.1 * step})
    logger.close()
    check_plots(tmp_path, capsys, ["reward.png", *TRACE_PLOTS])


def test_plot_of_a_trace_only_directory_writes_the_trace_figures(tmp_path, capsys):
    with JsonlTraceWriter(tmp_path / "trace.jsonl") as trace:
        sim.simulate(sim.presets.toy(target_steps=2), trace=trace)
    check_plots(tmp_path, capsys, TRACE_PLOTS)


def test_plot_compare_overlays_two_traces(tmp_path, capsys):
    for name, steps in (("a", 2), ("b", 3)):
        (tmp_path / name).mkdir()
        with JsonlTraceWriter(tmp_path / name / "trace.jsonl") as trace:
            sim.simulate(sim.presets.toy(target_steps=steps), trace=trace)
    assert main(["plot", str(tmp_path / "a"), "--compare", str(tmp_path / "b")]) == 0
    assert png_size(tmp_path / "a" / "plots" / "compare.png") == (900, 600)


def test_trace_figures_draw_preemptions_drops_and_lost_steps():
    trace = MemoryTrace()
    sim.simulate(sim.presets.checkpoint_study(), trace=trace)
    kinds = {e.kind for e in trace}
    assert {"preemption", "restart", "drop", "checkpoint_save"} <= kinds
    timeline = observe.timeline_figure(trace)
    handles, labels = timeline.axes[0].get_legend_handles_labels()
    assert {"preemption", "preempted (down)", "checkpoint save"} <= set(labels)
    # Thousands of pushes would merge into a bar: every k-th is marked, and the legend
    # says which of how many.
    pushes = sum(e.kind == "push" for e in trace)
    (push,) = [h for h, label in zip(handles, labels, strict=True) if label.startswith("push")]
    every = -(-pushes // sim.report.MAX_MARKS_PER_ROW)
    assert push.get_label() == f"push (1 in {every} of {pushes} marked)"
    assert len(push.get_xdata()) == len(range(0, pushes, every)) <= sim.report.MAX_MARKS_PER_ROW
    drops = observe.drops_figure(trace)
    reasons = {t.get_text().split(" (")[0].split(":")[0] for t in drops.axes[0].get_legend().texts}
    assert reasons == {str(e["reason"]) for e in trace if e.kind == "drop"}
    throughput = observe.throughput_figure(trace)
    assert all(ax.has_data() for ax in throughput.axes)


def test_plot_of_a_directory_without_a_run_exits_2_with_a_message(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "neither metrics.jsonl nor trace.jsonl" in capsys.readouterr().err


@pytest.mark.slow
def test_plot_writes_png_files_for_a_real_local_run(tmp_path, capsys, cache):
    config = small_run_config()
    with Experiment(config, run_dir=tmp_path, cache_dir=cache) as exp:
        exp.run(3)
    # Every step audits its data (audit.png); 3 steps attribute no drift (drift_every=10).
    check_plots(tmp_path, capsys, ["reward.png", "audit.png", *TRACE_PLOTS])
    # The same real run, exported for Perfetto, keeps the format's rules.
    assert main(["trace", str(tmp_path)]) == 0
    validate(json.loads((tmp_path / "run.perfetto.json").read_text()))


def metrics(n, offset=0.0):
    return [
        {"step": i, "reward/mean": offset + 0.05 * i, "train/ratio_mean": 1.0} for i in range(n)
    ]


def test_every_figure_function_returns_a_drawn_figure():
    rows = [{"k": 1, "pass@k": 0.2}, {"k": 2, "pass@k": 0.3}, {"k": 4, "pass@k": 0.4}]
    figures = [
        observe.reward_figure(metrics(5), [{"step": 0, "pass@1": 0.1}]),
        observe.curves_figure({"a": metrics(5), "b": metrics(5, 0.1)}, ["reward/mean"]),
        observe.pass_at_k_figure({"before": rows, "after": rows}),
        observe.compare_runs_figure(
            {
                "η=0 · grpo": {
                    "metrics": metrics(4),
                    "pass_at_k": rows,
                    "staleness": {0: 8},
                    "step_s": 0.5,
                },
                "η=2 · decoupled": {"metrics": metrics(4), "staleness": {0: 5, 1: 3}},
            }
        ),
        observe.update_figure(
            np.array([0.7, 1.0, 1.3]), np.array([-1.0, 0.5, 1.0]), {"a/b": 0.1, "c": 0.2}
        ),
        observe.comparison_figure({"a": 1.0, "b": 2.0}, ylabel="s"),
        observe.scaling_figure([64, 128, 256], {"η = 0": [1.0, 1.8, 3.0]}, ceiling=4.0),
        observe.overlay_figure({"latency (s)": ([0.1, 0.2, 0.3], [0.15, 0.25])}),
    ]
    for figure in figures:
        assert isinstance(figure, Figure)
        assert figure.axes and all(ax.has_data() for ax in figure.axes if ax.get_visible())


def test_bad_figure_input_names_the_problem():
    with pytest.raises(ValueError, match="one entry per token"):
        observe.update_figure(np.ones(3), np.ones(2), {})
    with pytest.raises(ValueError, match="has 2 values for 3 sizes"):
        observe.scaling_figure([1, 2, 4], {"x": [1.0, 2.0]})
    with pytest.raises(ValueError, match="keys"):
        observe.curves_figure({"a": metrics(2)}, [])
    with pytest.raises(ValueError, match="panels"):
        observe.overlay_figure({})


def test_held_out_pass_at_1_is_a_curve_with_its_band():
    """Evaluations every eval.every_steps draw a curve; their standard errors a band."""
    evals = [{"step": s, "pass@1": 0.2 + s / 100, "pass@1_se": 0.02} for s in (0, 10, 20)]
    figure = observe.reward_figure(metrics(21), evals)
    (axes,) = figure.axes
    (band,) = axes.collections  # fill_between
    low, high = band.get_paths()[0].vertices[:, 1].min(), band.get_paths()[0].vertices[:, 1].max()
    assert low == pytest.approx(0.2 - 1.96 * 0.02) and high == pytest.approx(0.4 + 1.96 * 0.02)
    labels = [t.get_text() for t in axes.get_legend().get_texts()]
    assert "held-out pass@1" in labels


def slow_start_trace(slots: int = 1) -> MemoryTrace:
    """A run whose set-up takes 50 of its 80 s: generations on ``slots`` slots of one
    worker from 50 s, train steps ending at 60 and 80 s."""
    trace = MemoryTrace()
    trace.record(0.0, "run_start", "controller")
    for slot in range(slots):
        trace.record(50.0, "generation_start", "worker-0", 0, sample=f"s{slot}")
        trace.record(55.0, "generation_end", "worker-0", 0, sample=f"s{slot}", tokens=4)
    trace.record(60.0, "train_step", "trainer", 1, step=1, samples=2, duration_s=5.0)
    trace.record(80.0, "train_step", "trainer", 2, step=2, samples=2, duration_s=5.0)
    return trace


def test_a_long_set_up_is_cut_from_the_time_axes_and_its_length_written():
    trace = slow_start_trace()
    timeline = observe.timeline_figure(trace).axes[0]
    # Cut to a sliver of 5% of the 30 s that follow the 50 s set-up.
    assert timeline.get_xlim() == pytest.approx((50.0 - 0.05 * 30.0, 80.0))
    assert "setup (warm start), 50 s, axis cut" in timeline.get_legend_handles_labels()[1]
    rate, share = observe.throughput_figure(trace).axes
    assert share.get_xlim() == pytest.approx((60.0, 80.0))  # from the first finished step
    assert "from the first step, 60 s after the start" in rate.get_title()


def test_many_slots_draw_as_sequences_in_flight_not_one_lane_each():
    few = observe.timeline_figure(slow_start_trace(slots=sim.report.MAX_LANES)).axes[0]
    assert "a worker's band is its slots" in few.get_title()
    slots = sim.report.MAX_LANES + 1
    many = observe.timeline_figure(slow_start_trace(slots=slots)).axes[0]
    assert f"sequences in flight, full = its {slots} slots" in many.get_title()
    # All slots busy from 50 to 55 s: the area is the band's full height there.
    (area,) = [p for p in many.patches if isinstance(p, StepPatch)]  # one version
    top = area.get_path().vertices[:, 1].max()
    assert top == pytest.approx(0 - 0.4 + 0.8)  # worker-0's band: row 0, height 0.8


def test_the_checkpoint_figure_marks_the_fitted_optimum_and_defines_its_symbols():
    study = sim.CheckpointStudy(
        (100.0, 200.0, 400.0),
        (0.3, 0.2, 0.25),
        220.0,
        200.0,
        230.0,
        save_s=60.0,
        mtbf_s=440.0,
        fit=(0.0, 10.0, 0.0002),
    )
    (axes,) = sim.checkpoint_figure(study).axes
    labels = axes.get_legend_handles_labels()[1]
    assert "Young: √(2δM) = 230 s\nδ = 60 s (checkpoint save)\nM = 440 s (MTBF)" in labels
    assert "fitted optimum 220 s" in labels
    assert axes.get_title()


def test_a_log_axis_labels_no_minor_ticks_and_each_bound_says_its_costs():
    figure = observe.scaling_figure(
        [64, 128, 256],
        {"η = 2, assumed costs": [1.0, 1.8, 3.0], "η = 2, compiled costs": [1.5, 2.5, 4.0]},
        ceiling={"trainer bound, assumed costs": 4.0, "trainer bound, compiled costs": 5.0},
    )
    figure.canvas.draw()
    (axes,) = figure.axes
    minor = [t.get_text() for t in axes.yaxis.get_minorticklabels()]
    assert not any(minor), minor
    labels = axes.get_legend_handles_labels()[1]
    assert {"trainer bound, assumed costs", "trainer bound, compiled costs"} <= set(labels)


def test_compare_draws_runs_of_different_sizes_each_as_a_share_of_its_total():
    small, large = MemoryTrace(), MemoryTrace()
    sim.simulate(sim.presets.toy(target_steps=2), trace=small)
    sim.simulate(sim.presets.toy(target_steps=20), trace=large)
    figure = observe.trace_overlay_figure(small, large)
    progress = figure.axes[3]
    assert progress.get_ylabel() == "share of the run's samples trained"
    assert max(line.get_ydata().max() for line in progress.get_lines()) == pytest.approx(1.0)
    assert figure.axes[0].get_legend_handles_labels()[1] == ["measured", "simulated"]


def test_plot_shows_a_bar_a_tick_a_figure_unless_told_not_to(tmp_path, capsys):
    with JsonlTraceWriter(tmp_path / "trace.jsonl") as trace:
        sim.simulate(sim.presets.toy(target_steps=2), trace=trace)
    assert main(["plot", str(tmp_path)]) == 0
    assert "plots: 100%" in capsys.readouterr().err.replace("\r", "\n")
    assert main(["plot", str(tmp_path), "--no-progress"]) == 0
    assert "plots" not in capsys.readouterr().err
