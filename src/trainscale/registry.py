"""One small name -> factory registry shared by models, datasets, compressors and modes.

Every pluggable piece of trainscale is found by name through a ``create_*``/``list_*`` pair built on
this class, so the CLI, the configs and the tests parametrised over every entry all see the same list.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from trainscale.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    factory: Callable[..., T]
    meta: dict[str, Any] = field(default_factory=dict)


class Registry(Generic[T]):
    """Maps names to factories; ``kind`` is used in error messages ("unknown model 'x'")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str | None = None, **meta: Any) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def decorator(factory: Callable[..., T]) -> Callable[..., T]:
            key = name or factory.__name__
            if key in self._entries:
                raise ValueError(f"{self.kind} '{key}' is registered twice")
            self._entries[key] = Entry(key, factory, dict(meta))
            return factory

        return decorator

    def remove(self, name: str) -> None:
        """Forget ``name`` (an entry registered for a while, e.g. a model instance ``trainscale.fit`` trains)."""
        self._entries.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> Entry[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(self.unknown_message(name)) from None

    def unknown_message(self, name: str) -> str:
        close = difflib.get_close_matches(name, self.names(), n=1, cutoff=0.5)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"unknown {self.kind} '{name}'{hint}; choose one of: {', '.join(self.names())}"

    def create(self, name: str, **kwargs: Any) -> T:
        return self.get(name).factory(**kwargs)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
