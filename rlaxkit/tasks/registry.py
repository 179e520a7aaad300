"""Tasks found by name, so YAML run configs can say ``task: {name: arithmetic, ...}``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from rlaxkit.tasks.base import Task

_REGISTRY: dict[str, tuple[type, Callable[[Any], Task]]] = {}
_Factory = TypeVar("_Factory", bound=Callable[[Any], Task])


def register_task(name: str, config_cls: type) -> Callable[[_Factory], _Factory]:
    """Class decorator: ``make_task(name, **kwargs)`` builds ``cls(config_cls(**kwargs))``."""

    def decorate(factory: _Factory) -> _Factory:
        if name in _REGISTRY:
            raise ValueError(f"task {name!r} is already registered")
        _REGISTRY[name] = (config_cls, factory)
        return factory

    return decorate


def task_names() -> list[str]:
    """The registered task names, sorted."""
    return sorted(_REGISTRY)


def task_config_class(name: str) -> type:
    """The config dataclass of task ``name``."""
    _check_name(name)
    return _REGISTRY[name][0]


def make_task(name: str, **options: Any) -> Task:
    """Builds the task registered as ``name`` from config keyword options.

    Lists are turned into tuples (YAML has no tuples; configs are frozen), and nested
    config dataclasses may be given as dicts.

    >>> make_task("arithmetic", max_digits=1).name
    'arithmetic'
    """
    _check_name(name)
    config_cls, factory = _REGISTRY[name]
    return factory(build_config(config_cls, options, where=f"task {name!r}"))


def build_config(config_cls: type, options: dict[str, Any], *, where: str) -> Any:
    """``config_cls(**options)`` with dicts for nested configs and lists as tuples."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for {where}; allowed: {sorted(fields)}")
    values = {}
    for key, value in options.items():
        default = fields[key].default
        factory = fields[key].default_factory
        if dataclasses.is_dataclass(default) or (
            factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory)
        ):
            nested_cls = type(default) if dataclasses.is_dataclass(default) else factory
            if isinstance(value, dict):
                value = build_config(nested_cls, value, where=f"{where}.{key}")
        values[key] = _tuplify(value)
    return config_cls(**values)


def _tuplify(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuplify(v) for v in value)
    return value


def _check_name(name: str) -> None:
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; registered tasks: {task_names()}")
