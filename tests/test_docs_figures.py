"""Every figure of the demo that the docs quote agrees with ``docs/demo_figures.json``,
which ``benchmarks/docs_figures.py`` writes from a demo run (no training here)."""

import doctest
import importlib.util
import json
import math
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "docs_figures.py"
spec = importlib.util.spec_from_file_location("bench_docs_figures", SCRIPT)
docs_figures = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = docs_figures
spec.loader.exec_module(docs_figures)


def test_every_quoted_demo_figure_agrees_with_the_measured_file():
    measured = json.loads(docs_figures.FIGURES_FILE.read_text())
    values = docs_figures.quotable(measured)
    assert measured["measured_on"]["command"] == "rlaxkit demo"
    assert all(math.isfinite(v) for v in measured["figures"].values())
    assert docs_figures.stale_quotes(values) == []
    quoted = {
        key
        for path in docs_figures.quoted_files()
        for _, key in docs_figures.quotes(path.read_text())
    }
    # The README and the LoRA section quote the demo's held-out pass@1 from the file.
    assert {"pass@1_before", "pass@1_after", "staleness_max"} <= quoted


def test_the_scripts_examples_run():
    assert doctest.testmod(docs_figures).failed == 0


def test_a_stale_quote_is_found_and_rewritten_at_its_own_decimals(tmp_path):
    (tmp_path / "docs").mkdir()
    readme, page = tmp_path / "README.md", tmp_path / "docs" / "page.md"
    readme.write_text("pass@1 0.812<!-- demo:pass@1_after --> (+30.9<!-- demo:gain --> points)\n")
    page.write_text("| 7<!-- demo:steps --> | 2<!-- demo:nothing --> |\n")
    figures = {"pass@1_after": 0.71625, "gain": 18.25000000000001, "steps": 200}
    assert docs_figures.stale_quotes(figures, tmp_path) == [
        "README.md: 0.812<!-- demo:pass@1_after --> should read 0.716",
        "README.md: +30.9<!-- demo:gain --> should read +18.3",
        "docs/page.md: 7<!-- demo:steps --> should read 200",
        "docs/page.md: 2<!-- demo:nothing --> names no figure of demo_figures.json",
    ]
    assert docs_figures.rewrite(figures, tmp_path) == 3
    assert readme.read_text() == (
        "pass@1 0.716<!-- demo:pass@1_after --> (+18.3<!-- demo:gain --> points)\n"
    )
    assert docs_figures.stale_quotes(figures, tmp_path) == [
        "docs/page.md: 2<!-- demo:nothing --> names no figure of demo_figures.json"
    ]
