"""Frozen dataclass configs to and from plain dicts and YAML, with errors that name the
field's dotted path (``runtime.num_workers: ...``) and the fix.

Works for any ``@dataclass`` tree whose fields are ``int``, ``float``, ``bool``, ``str``,
``Literal[...]``, ``X | None``, tuples/lists of those, ``dict``, or nested dataclasses.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from rlaxkit.rules.validation import is_int, is_number

T = TypeVar("T")
D = TypeVar("D", bound=dict[str, object])  # a dict changed in place and returned


def to_dict(config: object) -> Any:
    """Plain-data (YAML-safe) form of a dataclass tree."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, tuple | list):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    return config


def from_dict(cls: type[T], data: object, path: str = "") -> T:
    """Builds dataclass ``cls`` from plain data, validating types and names.

    Raises:
        ValueError: ``<dotted.path>: <what is wrong>``, for unknown fields, wrong types
            and values a config's own ``__post_init__`` rejects.
    """
    return _convert(cls, data, path or cls.__name__)


def convert(tp: object, value: object, path: str) -> object:
    """``value`` checked against (and, for lists, tuples and nested dataclasses, built as)
    the type ``tp``; ``ValueError`` names ``path`` as ``from_dict`` does."""
    return _convert(tp, value, path)


def _convert(tp: object, value: object, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, path)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[0] if len(errors) == 1 else f"{path}: {value!r} fits no option")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ValueError(f"{path}: must be one of {list(allowed)}, got {value!r}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass(tp, value, path)
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ValueError(f"{path}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"{path}: expected a number, got {value!r}") from None
        if not is_number(value):
            raise ValueError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if not is_int(value):
            raise ValueError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp in (bool, str):
        if not isinstance(value, tp):
            raise ValueError(f"{path}: expected {tp.__name__}, got {value!r}")
        return value
    return value


def _dataclass(cls: type, value: object, path: str) -> object:
    if dataclasses.is_dataclass(value) and isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a mapping of {cls.__name__} fields, got {value!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {unknown}; known fields: {sorted(fields)}")
    required = [
        name
        for name, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in value]
    if missing:
        raise ValueError(f"{path}: missing required field(s) {missing}; give them in {path}")
    kwargs = {k: _convert(hints[k], v, f"{path}.{k}") for k, v in value.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:  # TypeError: a __post_init__ compared a bad type
        raise ValueError(f"{path}: {err}") from None


def merge(defaults: object, given: object) -> Any:
    """``given`` laid over ``defaults``: mappings merge key by key, all the way down;
    anything else in ``given`` replaces the default. Neither argument is changed.

    A config file merges onto the run's defaults this way, as ``--set`` overrides do, so
    a section given in part keeps the run's values for the fields it leaves out.

    >>> merge({"a": {"b": 1, "c": 2}, "d": [1]}, {"a": {"b": 5}, "d": [2, 3]})
    {'a': {'b': 5, 'c': 2}, 'd': [2, 3]}
    """
    if not (isinstance(defaults, dict) and isinstance(given, dict)):
        return copy.deepcopy(given)
    merged = copy.deepcopy(defaults)
    for key, value in given.items():
        merged[key] = merge(defaults[key], value) if key in defaults else value
    return merged


def apply_overrides(data: D, overrides: list[str]) -> D:
    """Applies ``key.sub=value`` overrides (values parsed as YAML) to a nested dict.

    An optional section that is unset (``None``) becomes one when a key below it is set:

    >>> apply_overrides({"a": {"b": 1}}, ["a.b=2", "c=[1, 2]"])
    {'a': {'b': 2}, 'c': [1, 2]}
    >>> apply_overrides({"lora": None}, ["lora.rank=8"])
    {'lora': {'rank': 8}}
    """
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        node: dict[str, object] = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ValueError(f"override {key}: {part} is not a section")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            raise ValueError(
                f"override {item!r}: the value is not valid YAML ({yaml_problem(error)}); "
                "close its brackets or quotes, e.g. tracking=[jsonl]"
            ) from None
    return data


def yaml_problem(error: yaml.YAMLError) -> str:
    """``"line 3, column 7: could not find expected ':'"`` from a YAML parser error."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def read_yaml(path: str | Path) -> object:
    """A YAML file's data; a syntax error raises ``ValueError`` naming the file, line and
    column, not the parser's ``"<unicode string>"``."""
    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ValueError(
            f"{path}: YAML syntax error at {yaml_problem(error)}; fix the file "
            "(a field is `name: value`, a list `[a, b]`, nesting by indentation)"
        ) from None


def load_yaml(
    cls: type[T],
    path: str | Path,
    overrides: list[str] | None = None,
    root: str = "config",
    defaults: Callable[[dict[str, object]], dict[str, object]] | None = None,
) -> T:
    """Reads a YAML config file into ``cls``, after ``key=value`` overrides; errors name
    fields as ``<root>.<dotted.path>``.

    The file is merged (see :func:`merge`) onto ``to_dict(cls())`` when ``cls`` has a
    default for every field: a section the file gives in part keeps the defaults of the
    whole config for the rest (``sampling: {n: 4}`` keeps the run's ``max_new_tokens``,
    not ``SamplingConfig``'s own), exactly as ``--set sampling.n=4`` would.
    ``defaults``, given the file's data, returns other defaults to merge onto.
    """
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file must be a mapping at the top level")
    data = merge(defaults(data) if defaults else _defaults(cls), data)
    return from_dict(cls, apply_overrides(data, overrides or []), path=root)


def _defaults(cls: type) -> dict[str, object]:
    """``to_dict(cls())``, or ``{}`` when ``cls`` has a field without a default."""
    try:
        return to_dict(cls())
    except TypeError:
        return {}


def dump_yaml(config: object, path: str | Path) -> None:
    """Writes a dataclass tree as YAML that ``load_yaml`` reads back."""
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
