"""The layout's rules, checked over the source (``docs/architecture.md``, "Packages"):

- no import cycles between modules of ``rlaxkit`` and ``sim`` (imports for type checking
  included) but those listed below, a list that only shrinks;
- ``sim`` imports nothing of rlaxkit but the shared rules (``rlaxkit.rules``), and the
  rules import no JAX, no SimPy and nothing of rlaxkit outside themselves;
- the notebooks import public names only: from a package's surface (its ``__all__``) or
  a top-level module of rlaxkit, never from a package's implementation module;
- every package's surface resolves;
- no module over 500 lines and no class over 20 instance attributes, but those listed,
  each at most at its size when listed (the lists only shrink);
- ``Any`` named at most ``MAX_ANY_NAMES`` times in ``rlaxkit`` and ``sim`` (a ceiling that
  only shrinks).
"""

import ast
import importlib

import pytest
from layout_graph import ROOT, cycles, import_graph, module_name, project_modules
from test_runtime_shape import own_attributes

# Cycles allowed for now, each the list of its modules; the list only shrinks. None is
# left, so any cycle fails the test. Remove an entry when its cycle is gone.
KNOWN_CYCLES: list[list[str]] = []

MAX_LINES = 500
# Modules over the limit and their size when listed: a module may shrink, not grow.
LONG_MODULES = {
    "rlaxkit/inference/engine.py": 921,
    "rlaxkit/cli.py": 773,
    "rlaxkit/tasks/sandbox.py": 677,
    "rlaxkit/observe/perfetto.py": 631,
    "rlaxkit/param_server/delta_store.py": 621,
    "rlaxkit/inference/programs.py": 594,
    "sim/calibration/calibrate.py": 553,
    "rlaxkit/tasks/episodes.py": 593,
    "rlaxkit/config/run.py": 538,
    "rlaxkit/observe/tracking.py": 518,
}

MAX_ATTRIBUTES = 20
# Classes over the limit (module, class) and their count when listed.
WIDE_CLASSES = {
    ("rlaxkit/algorithms/config.py", "LossConfig"): 23,
    ("rlaxkit/config/run.py", "RunConfig"): 24,
    ("rlaxkit/planning/specs.py", "PlanConfig"): 21,
    ("sim/metrics.py", "SimResult"): 24,
}

HEAVY = {"jax", "jaxlib", "flax", "optax", "orbax", "simpy", "ray", "matplotlib"}


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_no_import_cycles_but_the_listed(graph):
    edges = {name: imports.runs | imports.typing_only for name, imports in graph.items()}
    found = {tuple(c) for c in cycles(edges)}
    known = {tuple(sorted(c)) for c in KNOWN_CYCLES}
    assert not found - known, f"new import cycles: {sorted(found - known)}"
    assert not known - found, (
        f"gone or changed: take them off KNOWN_CYCLES: {sorted(known - found)}"
    )


def test_the_simulator_imports_only_the_shared_rules(graph):
    reaches = {
        (name, target)
        for name, imports in graph.items()
        if name.split(".")[0] == "sim"
        for target in imports.runs | imports.typing_only
        if target.split(".")[0] == "rlaxkit" and not target.startswith("rlaxkit.rules")
    }
    assert not reaches, f"sim imports rlaxkit outside rlaxkit.rules: {sorted(reaches)}"


def test_the_rules_import_no_jax_no_simpy_and_nothing_above_them(graph):
    rules = {name: imports for name, imports in graph.items() if name.startswith("rlaxkit.rules")}
    assert len(rules) >= 10
    for name, imports in rules.items():
        assert not imports.external & HEAVY, f"{name} imports {sorted(imports.external & HEAVY)}"
        above = {t for t in imports.runs | imports.typing_only if not t.startswith("rlaxkit.rules")}
        assert not above, f"{name} imports {sorted(above)}"


def _surface(module: str) -> set[str] | None:
    """A package's or module's ``__all__`` as written (``None`` when it has none)."""
    path = project_modules()[module]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return None


def _notebook_imports():
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                yield path.name, node.module, [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield path.name, alias.name, []


def test_the_notebooks_import_public_names_only():
    modules = project_modules()
    seen = 0
    for notebook, module, names in _notebook_imports():
        if module.split(".")[0] not in ("rlaxkit", "sim"):
            continue
        seen += 1
        assert module in modules, f"{notebook}: {module} is not a module of the project"
        is_package = modules[module].name == "__init__.py"
        top_level = module.count(".") == 1 and not is_package
        assert is_package or top_level or module == "rlaxkit", (
            f"{notebook}: imports from {module}, a package's implementation module; import "
            f"from {module.rpartition('.')[0]} (its __all__)"
        )
        surface = _surface(module)
        for name in names:
            if f"{module}.{name}" in modules:
                continue  # a subpackage or module, such as sim.presets
            assert not name.startswith("_"), f"{notebook}: {module}.{name} is private"
            if surface is not None:
                assert name in surface, f"{notebook}: {name} is not in {module}.__all__"
    assert seen > 20


@pytest.mark.parametrize(
    "package",
    sorted(
        name
        for name, path in project_modules().items()
        if path.name == "__init__.py" and name.count(".") == 1
    ),
)
def test_every_name_of_a_package_surface_resolves(package):
    surface = _surface(package)
    assert surface, f"{package}/__init__.py has no __all__"
    loaded = importlib.import_module(package)
    missing = [name for name in sorted(surface) if not hasattr(loaded, name)]
    assert not missing, f"{package}.__all__ names what it does not have: {missing}"


def _sources():
    return sorted(p for package in ("rlaxkit", "sim") for p in (ROOT / package).rglob("*.py"))


def test_no_module_over_the_line_limit_but_the_listed():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _sources()}
    over = {path: n for path, n in sizes.items() if n > MAX_LINES}
    grown = {
        p: (n, LONG_MODULES.get(p)) for p, n in over.items() if n > LONG_MODULES.get(p, MAX_LINES)
    }
    assert not grown, f"over {MAX_LINES} lines (size, listed size): {grown}"
    short = sorted(p for p in LONG_MODULES if sizes.get(p, 0) <= MAX_LINES)
    assert not short, f"now within {MAX_LINES} lines or gone: take them off LONG_MODULES: {short}"


def test_no_class_over_the_attribute_limit_but_the_listed():
    classes: dict[str, tuple[str, ast.ClassDef]] = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, (str(path.relative_to(ROOT)), node))

    def attributes(node: ast.ClassDef, seen: frozenset[str] = frozenset()) -> set[str]:
        names = own_attributes(node)
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes and base.id not in seen:
                names |= attributes(classes[base.id][1], seen | {node.name})
        return names

    counts = {(path, name): len(attributes(node)) for name, (path, node) in classes.items()}
    wide = {key: n for key, n in counts.items() if n > WIDE_CLASSES.get(key, MAX_ATTRIBUTES)}
    assert not wide, f"classes over {MAX_ATTRIBUTES} instance attributes: {wide}"
    narrow = sorted(key for key in WIDE_CLASSES if counts.get(key, 0) <= MAX_ATTRIBUTES)
    assert not narrow, f"take them off WIDE_CLASSES: {narrow}"


def test_the_graph_reads_relative_imports():
    """``from .engine import Simulation`` in ``sim/__init__.py`` is an edge to sim.engine."""
    modules = project_modules()
    assert module_name(modules["sim"]) == "sim"
    assert "sim.engine" in import_graph()["sim"].runs


# Every ``Any`` (the name, or ``typing.Any``) in rlaxkit and sim, counted in the syntax
# tree. The goal is 350: lower the ceiling as types replace them, never raise it.
MAX_ANY_NAMES = 341


def test_any_is_named_at_most_the_ceiling():
    count = sum(
        (isinstance(node, ast.Name) and node.id == "Any")
        or (isinstance(node, ast.Attribute) and node.attr == "Any")
        for path in _sources()
        for node in ast.walk(ast.parse(path.read_text()))
    )
    assert count <= MAX_ANY_NAMES, f"Any is named {count} times, over {MAX_ANY_NAMES}"


# The whole run, by the names it goes by: a function takes the narrow protocol of what it
# touches (``RoundTarget``, ``FaultTarget``, ``StepTarget``, ``AgentTarget``) instead.
WHOLE_RUN = {"Experiment", "RayExperiment", "Loop"}


def test_no_function_takes_the_whole_run():
    def names(annotation: ast.expr | None) -> set[str]:
        if annotation is None:
            return set()
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            return set(annotation.value.replace("|", " ").replace("[", " ").split())
        return {
            n.id if isinstance(n, ast.Name) else n.attr
            for n in ast.walk(annotation)
            if isinstance(n, ast.Name | ast.Attribute)
        }

    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                arguments = node.args
                every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
                every += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
                for argument in every:
                    if names(argument.annotation) & WHOLE_RUN:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {argument.arg}")
    assert not found, f"parameters typed as the whole run: {found}"
