"""``--compress`` specs of the planner: ``METHOD[:key=value,...]``, e.g. ``topk:ratio=0.01,granularity=entire``.

A profile measures several compressors at once and a plan names one of them, so each is a single string:
the registered method, its parameters (those ``create_compressor`` takes) and the granularity. The
canonical text (sorted keys, the method's registry name) is the key under which a profile stores it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainscale.compression.base import canonical_method, compressor_params, create_compressor, list_compressors
from trainscale.compression.ddp_hook import GRANULARITIES, canonical_granularity
from trainscale.errors import ConfigError

DENSE = "none"


@dataclass(frozen=True)
class MethodSpec:
    method: str
    granularity: str = "layerwise"
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        keys = [f"{k}={v}" for k, v in sorted(self.params.items())]
        if self.granularity != "layerwise":
            keys.append(f"granularity={self.granularity}")
        return self.method + (":" + ",".join(keys) if keys else "")

    @property
    def dense(self) -> bool:
        return self.method == DENSE


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_spec(text: str) -> MethodSpec:
    """``topk:ratio=0.01`` -> MethodSpec; a bad method, key or value is a one-line ConfigError."""
    name, _, rest = text.strip().partition(":")
    method = canonical_method(name or DENSE)
    if method not in list_compressors():
        raise ConfigError(f"--compress {text!r}: unknown method {name!r}; known: {', '.join(list_compressors())}")
    params: dict[str, Any] = {}
    granularity = "layerwise"
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"--compress {text!r}: {item!r} is not key=value (e.g. topk:ratio=0.01)")
        if key == "granularity":
            if value not in GRANULARITIES:
                raise ConfigError(f"--compress {text!r}: granularity is one of {', '.join(GRANULARITIES)}")
            granularity = canonical_granularity(value)
            continue
        if key not in compressor_params(method) or key == "seed":
            accepted = [a for a in compressor_params(method) if a != "seed"]
            raise ConfigError(f"--compress {text!r}: {method} takes {', '.join(accepted) or 'no parameters'} "
                              f"and granularity, not {key!r}")
        params[key] = _value(value)
    spec = MethodSpec(method, granularity, params)
    try:
        create_compressor(method, **params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--compress {text!r}: {exc}") from None
    return spec
