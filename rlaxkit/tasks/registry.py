"""Tasks found by name, so YAML run configs can say ``task: {name: arithmetic, ...}``."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from rlaxkit.config.io import convert
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


def unregister_task(name: str) -> None:
    """Removes task ``name`` (registered by a test or a notebook for a while)."""
    _check_name(name)
    del _REGISTRY[name]


def task_names() -> list[str]:
    """The registered task names, sorted."""
    return sorted(_REGISTRY)


def task_config_class(name: str) -> type:
    """The config dataclass of task ``name``."""
    _check_name(name)
    return _REGISTRY[name][0]


def make_task(name: str, **options: object) -> Task:
    """Builds the task registered as ``name`` from config keyword options.

    Lists are turned into tuples (YAML has no tuples; configs are frozen), and nested
    config dataclasses may be given as dicts.

    >>> make_task("arithmetic", max_digits=1).name
    'arithmetic'
    """
    _check_name(name)
    config_cls, factory = _REGISTRY[name]
    return factory(build_config(config_cls, options, where=f"task {name!r}"))


def build_config(config_cls: type, options: Mapping[str, object], *, where: str) -> Any:
    """``config_cls(**options)``, each option checked against its field's type.

    Nested configs may be given as dicts and lists become tuples. A number is passed as
    given: the config's ``__post_init__`` checks its type together with its range, so
    ``max_digits="two"`` says ``max_digits: must be an integer in [1, 18], got 'two'``.

    Raises:
        ValueError: ``"{where} options: {option}: {what is wrong}"``.
    """
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for {where}; allowed: {sorted(fields)}")
    hints = typing.get_type_hints(config_cls)
    try:
        values = {
            key: value if _is_number_type(hints[key]) else convert(hints[key], value, key)
            for key, value in options.items()
        }
        return config_cls(**values)
    except (TypeError, ValueError) as err:  # TypeError: a check met a value of a wrong type
        raise ValueError(f"{where} options: {err}") from None


def _is_number_type(tp: object) -> bool:
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    return all(a in (int, float) for a in args)


def _check_name(name: str) -> None:
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; registered tasks: {task_names()}")
