"""The conda route (environment.yml) and the pip route (pyproject.toml) agree."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_environment_yml_matches_pyproject():
    project = _pyproject()
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    python = [d for d in deps if isinstance(d, str) and d.startswith("python")]
    assert python, "environment.yml must pin python"
    assert python[0].replace("python", "") == project["requires-python"]
    pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    editable = [p for p in pip if p.startswith("-e")]
    assert len(editable) == 1, "environment.yml installs the package itself, editable, once"
    extras = set(re.search(r"\[(.*)\]", editable[0]).group(1).split(","))
    assert extras == set(project["optional-dependencies"]), (
        "environment.yml installs every extra of pyproject.toml, as `make` does"
    )
    others = [p for p in pip if not p.startswith("-e")]
    assert not others, f"packages outside pyproject.toml in environment.yml: {others}"


def test_makefile_installs_the_same_extras():
    project = _pyproject()
    makefile = (ROOT / "Makefile").read_text()
    match = re.search(r'-e "\.\[(.*?)\]"', makefile)
    assert match, "Makefile installs the package editable with its extras"
    assert set(match.group(1).split(",")) == set(project["optional-dependencies"])


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make demo" in readme
    assert "make test" in ci
