"""The demo's measured figures in one file, ``docs/demo_figures.json``, and the docs quoting it.

Runs ``rlaxkit demo`` into a temporary folder (or reads a finished demo run given with
``--from``), writes its figures to ``docs/demo_figures.json`` with what they were measured
on, and rewrites every quote of them in ``README.md`` and ``docs/*.md``. A quote is a
number followed by a marker naming its figure, ``0.716<!-- demo:pass@1_after -->`` (the
marker does not show in rendered Markdown); it is rewritten at the decimals it shows, and
a leading ``+`` is kept. ``tests/test_docs_figures.py`` checks that every quote agrees with
the file, so a figure is measured here once and never copied by hand.

Usage::

    python benchmarks/docs_figures.py                   # runs the demo: minutes on 2 cores
    python benchmarks/docs_figures.py --from runs/demo  # a finished demo run
    python benchmarks/docs_figures.py --check           # compares the docs with the file

The last line printed is one JSON object: the figures, and the quotes rewritten.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIGURES_FILE = ROOT / "docs" / "demo_figures.json"
# A quoted figure: a number, then the marker that names it.
QUOTE = re.compile(r"(?P<number>[-+]?\d+(?:\.\d+)?)<!-- demo:(?P<key>[\w@.]+) -->")


def quoted_files(root: Path = ROOT) -> list[Path]:
    """The files whose quotes are checked and rewritten: the README and ``docs/*.md``."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def measure(run_dir: Path) -> dict[str, Any]:
    """The figures of a finished demo run in ``run_dir``, from its ``summary.json``,
    ``metrics.jsonl`` and ``trace.jsonl``."""
    import jax

    from rlaxkit import __version__

    summary = json.loads((run_dir / "summary.json").read_text())
    if summary.get("status") != "finished":
        raise ValueError(f"{run_dir}: the run is {summary.get('status')}, not finished")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    after = {row["k"]: row for row in summary["eval_after"]}
    trace = run_dir / "trace.jsonl"
    figures = {
        "pass@1_before": summary["pass@1_before"],
        "pass@1_after": summary["pass@1_after"],
        "pass@1_gain_points": 100 * (summary["pass@1_after"] - summary["pass@1_before"]),
        "pass@4_after": after[4]["pass@k"],
        "maj@4_after": after[4]["maj@k"],
        "eval_seed": summary["eval_seed"],
        "steps": summary["steps"],
        "staleness_max": max(m["staleness/max"] for m in metrics),
        "dropped_filtered": summary["buffer"]["dropped_by_reason"].get("filtered", 0),
        "trace_mb": trace.stat().st_size / 1e6 if trace.exists() else None,
        "goodput": summary["goodput"],
        "wall_s": summary["wall_s"],
        "samples_per_s_median": statistics.median(m["throughput/samples_per_s"] for m in metrics),
    }
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    measured_on = {
        "command": "rlaxkit demo",
        "rlaxkit": __version__,
        "commit": commit or None,
        "backend": jax.default_backend(),
        "cpu_cores": len(os.sched_getaffinity(0)),
    }
    return {"figures": figures, "measured_on": measured_on}


def quotable(measured: dict[str, Any]) -> dict[str, Any]:
    """What a quote may name: the figures and what they were measured on (``cpu_cores``)."""
    return {**measured["measured_on"], **measured["figures"]}


def quotes(text: str) -> list[tuple[str, str]]:
    """``(number as written, figure name)`` of every quote in ``text``."""
    return [(m["number"], m["key"]) for m in QUOTE.finditer(text)]


def render(value: float, written: str) -> str:
    """``value`` as ``written`` shows its figure: the same decimals, a ``+`` kept.

    >>> render(0.71625, "0.812"), render(18.25, "+30.9"), render(200, "200")
    ('0.716', '+18.2', '200')
    """
    decimals = len(written.split(".")[1]) if "." in written else 0
    text = f"{value:.{decimals}f}"
    return f"+{text}" if written.startswith("+") and value >= 0 else text


def stale_quotes(figures: dict[str, Any], root: Path = ROOT) -> list[str]:
    """One line per quote that disagrees with ``figures`` or names none of them."""
    problems = []
    for path in quoted_files(root):
        for number, key in quotes(path.read_text()):
            where = f"{path.relative_to(root)}: {number}<!-- demo:{key} -->"
            if figures.get(key) is None:
                problems.append(f"{where} names no figure of {FIGURES_FILE.name}")
            elif render(figures[key], number) != number:
                problems.append(f"{where} should read {render(figures[key], number)}")
    return problems


def rewrite(figures: dict[str, Any], root: Path = ROOT) -> int:
    """Rewrites every quote of a known figure in place; returns how many changed."""
    changed = 0

    def fresh(match: re.Match[str]) -> str:
        nonlocal changed
        number, key = match["number"], match["key"]
        if figures.get(key) is None:
            return match[0]
        value = render(figures[key], number)
        changed += value != number
        return f"{value}<!-- demo:{key} -->"

    for path in quoted_files(root):
        text = path.read_text()
        new = QUOTE.sub(fresh, text)
        if new != text:
            path.write_text(new)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="run_dir", help="a finished demo run to read")
    parser.add_argument("--check", action="store_true", help="compare the docs, change nothing")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale_quotes(quotable(json.loads(FIGURES_FILE.read_text())))
        print("\n".join(problems) or "every quote agrees with " + str(FIGURES_FILE.name))
        return 1 if problems else 0
    with tempfile.TemporaryDirectory() as work:
        run_dir = Path(args.run_dir) if args.run_dir else Path(work) / "demo"
        if not args.run_dir:
            from rlaxkit.cli import main as rlaxkit

            if rlaxkit(["demo", "--run-dir", str(run_dir)]) != 0:
                raise SystemExit("rlaxkit demo failed")
        measured = measure(run_dir)
    FIGURES_FILE.write_text(json.dumps(measured, indent=2) + "\n")
    changed = rewrite(quotable(measured))
    print(json.dumps({**measured, "quotes_rewritten": changed}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
