"""The notebooks: each ``.ipynb`` is its ``.py`` twin without outputs, and each executes.

The ``.py`` files (jupytext percent format) are the reviewed source; the ``.ipynb``
files are what a researcher opens. Execution uses the small settings the notebooks read
from ``RLAXKIT_NOTEBOOK_SMALL=1``; any cell error fails the test. Regenerate a pair after
editing the ``.py``: ``jupytext --sync notebooks/NAME.py`` (or ``--to ipynb``).

Each notebook runs both ways the README offers, from a folder other than ``notebooks/``:
the ``.ipynb`` in a kernel started in the repository root, the ``.py`` as a script
(``python notebooks/NAME.py``, no main guard) from a temporary folder.
"""

import os
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
TIMEOUT_S = 300  # per cell; the whole set must stay well under 6 minutes in CI


def _cells(notebook) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


def test_the_eight_notebooks_are_there():
    names = [p.stem[:2] for p in SOURCES]
    assert names == ["01", "02", "03", "04", "05", "06", "07", "08"], names


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_ipynb_is_in_sync_with_its_py_and_has_no_outputs(source):
    paired = source.with_suffix(".ipynb")
    assert paired.exists(), f"{paired.name} is missing: run `jupytext --to ipynb {source}`"
    from_py = jupytext.read(source)
    from_ipynb = nbformat.read(paired, as_version=4)
    assert _cells(from_ipynb) == _cells(from_py), (
        f"{paired.name} differs from {source.name}: run `jupytext --sync {source}`"
    )
    for i, cell in enumerate(from_ipynb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{paired.name} cell {i} has outputs; strip them"
            assert cell.execution_count is None, f"{paired.name} cell {i} has a count"
    assert "parameters" in {tag for c in from_py.cells for tag in c.metadata.get("tags", [])}, (
        f"{source.name} needs a cell tagged 'parameters' that reads RLAXKIT_NOTEBOOK_SMALL"
    )
    assert _cells(from_py)[-1][0] == "code", f"{source.name} must end with a figure cell"


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_notebook_executes_with_small_settings(source, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("RLAXKIT_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    notebook = nbformat.read(source.with_suffix(".ipynb"), as_version=4)
    client = NotebookClient(
        notebook,
        timeout=TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS.parent)}},  # the repository root
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    last = notebook.cells[-1]
    kinds = {key for output in last.outputs for key in output.get("data", {})}
    assert "image/png" in kinds, f"{source.name}: the last cell must display a figure"


# Every notebook as a script too (issue #65): 03 and 04 start sweep processes (a script
# has no __main__ guard), 04 and 08 read stored plans by path, and any notebook may come
# to depend on the folder it runs from; the kernel test above runs them from the
# repository root, this one from a temporary folder.
SCRIPT_SOURCES = SOURCES


@pytest.mark.slow
@pytest.mark.parametrize("source", SCRIPT_SOURCES, ids=lambda p: p.stem)
def test_notebook_runs_as_a_script_from_another_folder(source, tmp_path):
    """``python notebooks/NAME.py`` from any folder: the sweep's processes must not run
    the script again, and paths must not depend on the current folder."""
    env = {
        **os.environ,
        "RLAXKIT_NOTEBOOK_SMALL": "1",
        "MPLBACKEND": "Agg",
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
        "PYTHONPATH": os.pathsep.join([str(NOTEBOOKS.parent), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(source)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S * 2,
    )
    assert done.returncode == 0, f"{source.name} as a script:\n{done.stderr[-4000:]}"
