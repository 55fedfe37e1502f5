"""One small name -> factory registry shared by models, datasets, compressors and modes.

Every pluggable piece of trainscale is found by name through a ``create_*``/``list_*`` pair built on
this class, so the CLI, the configs and the tests parametrised over every entry all see the same list.

A registry made with ``importable=...`` also takes user code by import path, ``package.module:attr``
(``--model my_pkg.nets:build``): ``get`` imports the module and returns an ``Entry`` like a built-in's, with the
registry's default metadata (or the metadata the object was registered with, when the user's module registers
it with the registry's own decorator). Every process resolves a name the same way, with this one function, so
a worker finds the same factory the launcher checked. ``parse_args`` reads the ``KEY=VALUE`` arguments such a
factory is called with (``--model-arg depth=4``).
"""

from __future__ import annotations

import difflib
import importlib
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

from trainscale.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    factory: Callable[..., T]
    meta: dict[str, Any] = field(default_factory=dict)


class Registry(Generic[T]):
    """Maps names to factories; ``kind`` is used in error messages ("unknown model 'x'"). ``importable``: the
    metadata of an entry found by import path (None: names only)."""

    def __init__(self, kind: str, importable: Mapping[str, Any] | None = None) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}
        self._imported: dict[str, tuple[ModuleType | None, Entry[T]]] = {}  # by path, with the module it came from
        self.importable = dict(importable) if importable is not None else None

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
        """The entry of a registered name or, in an importable registry, of an import path ``module:attr``."""
        if name in self._entries:
            return self._entries[name]
        if self.importable is not None and is_import_path(name):
            module = name.partition(":")[0]
            cached = self._imported.get(name)
            if cached is None or sys.modules.get(module) is not cached[0]:  # imported anew (a forked worker's)
                entry = self._import(name)
                cached = self._imported[name] = (sys.modules.get(module), entry)
            return cached[1]
        raise ConfigError(self.unknown_message(name))

    def _import(self, path: str) -> Entry[T]:
        factory = load_object(path, self.kind)
        registered = next((e for e in self._entries.values() if e.factory is factory), None)
        meta = {**(self.importable or {}), **(registered.meta if registered else {})}
        return Entry(path, factory, meta)

    def unknown_message(self, name: str) -> str:
        shown = name if len(name) <= 80 else f"{name[:77]}..."  # a line, however long the text given
        if self.importable is not None and ("." in name or ":" in name):
            module, _, attr = shown.partition(":")
            example = f"{module or 'package.module'}:{attr or 'function'}" if ":" in name else f"{shown}:function"
            return (
                f"{self.kind} '{shown}' is neither a registered name nor an import path; name your code as "
                f"package.module:function, with a colon before the function (e.g. {example})"
            )
        close = difflib.get_close_matches(name, self.names(), n=1, cutoff=0.5)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        paths = " or an import path package.module:function" if self.importable is not None else ""
        return f"unknown {self.kind} '{shown}'{hint}; choose one of: {', '.join(self.names())}{paths}"

    def create(self, name: str, **kwargs: Any) -> T:
        return self.get(name).factory(**kwargs)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def is_import_path(name: str) -> bool:
    """``package.module:attr`` (``attr`` may be dotted: ``nets:Builders.small``)."""
    return IMPORT_PATH.match(name) is not None


def load_object(path: str, kind: str) -> Callable[..., Any]:
    """The callable at ``module:attr``; anything that stops it (the module or one it imports is missing, the
    module raises, no such attribute, not callable) is a ConfigError naming the path and the reason."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except BaseException as exc:  # noqa: BLE001  (a user module may raise anything, SystemExit included)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise ConfigError(
            f"{kind} '{path}': cannot import module '{module_name}' ({_reason(exc)}); check that it is importable "
            f"from the current folder or PYTHONPATH (python -c 'import {module_name}')"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{kind} '{path}': module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{kind} '{path}' is a {type(obj).__name__}, not a function or class to call")
    return obj


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__


def import_root(path: str) -> str | None:
    """The ``sys.path`` folder that the top-level package of an imported ``path`` was found in (None when it was
    not imported from a folder), so processes started later can be given the same folder."""
    top = sys.modules.get(path.partition(":")[0].split(".")[0])
    where = getattr(top, "__file__", None)
    if where is None:
        return None
    file = Path(where).resolve()
    return str(file.parent.parent if file.name == "__init__.py" else file.parent)


# ------------------------------------------------------------------------------ KEY=VALUE arguments

ARG_KEY = re.compile(r"^[A-Za-z_]\w*$")


def parse_value(text: str) -> Any:
    """A ``--model-arg`` value: ``true``/``false``, an integer, a number, or text; quotes keep text as text
    (``name="4"`` is the string 4)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_args(items: Sequence[str], flag: str = "--model-arg") -> dict[str, Any]:
    """``["depth=4", "act=gelu"]`` -> ``{"depth": 4, "act": "gelu"}``; a malformed item or a key given twice is a
    ConfigError naming it."""
    args: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not ARG_KEY.match(key):
            raise ConfigError(f"{flag} {item!r}: give KEY=VALUE with KEY a Python identifier, e.g. {flag} depth=4")
        if key in args:
            raise ConfigError(f"{flag} {key} is given twice; keep one")
        args[key] = parse_value(text.strip())
    return args


def format_args(table: Mapping[str, Any], flag: str = "--model-arg") -> list[str]:
    """A TOML table (``{depth = 4, act = "gelu"}``) as ``KEY=VALUE`` items that ``parse_args`` reads back to the
    same values (text that would read as a number or boolean is quoted)."""
    items = []
    for key, value in table.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        elif isinstance(value, str):
            text = value if parse_value(value) == value and not _quoted(value) else f'"{value}"'
        else:
            raise ConfigError(
                f"{flag} {key}: values are numbers, true/false or text, got {type(value).__name__} {value!r}"
            )
        items.append(f"{key}={text}")
    return items


def _quoted(text: str) -> bool:
    return len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'"
