"""A small name → object registry, so configs and YAML name algorithm parts as strings."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Objects of one kind (advantage estimators, surrogates, presets) found by name.

    >>> kinds = Registry[int]("number")
    >>> _ = kinds.register("one")(1)
    >>> kinds.get("one"), kinds.names()
    (1, ('one',))
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering its argument as ``name``; names are unique."""

        def decorate(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return decorate

    def get(self, name: str) -> T:
        """The object registered as ``name``; ``ValueError`` listing the names otherwise."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {self.names()}")
        return self._entries[name]

    def names(self) -> tuple[str, ...]:
        """The registered names, sorted."""
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
