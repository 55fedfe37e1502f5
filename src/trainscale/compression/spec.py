"""The one description of a run's compression, shared by everything that compresses or plans to.

A :class:`CompressionSpec` names the method (its registry name), the keyword parameters its compressor
takes, the granularity (each parameter on its own, or the whole model as one vector), error feedback and
the dense warm-up, and which small tensors a layerwise sparsifier sends dense (``dense_below``). It is read
once from the configuration's flags (``from_config``: ``--qsgd-bucket`` is QSGD's ``bucket_size``,
``--powersgd-rank`` PowerSGD's ``rank``; ``FLAG_PARAMS`` is the only such map) or from the planner's
one-string form (``parse``: ``topk:ratio=0.01,granularity=entire``), and used as is by the DDP hook and
the reducer of sync mode, local SGD and DiLoCo (``hook_state``), by the parameter server's pushes
(``compressor``, the same on the worker and the servers) and by the planner (``text``, the key under which a
profile stores a compressor's timings).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from torch import nn

from trainscale.compression.base import (
    Compressor,
    canonical_method,
    compressor_class,
    compressor_params,
    create_compressor,
    list_compressors,
)
from trainscale.compression.ddp_hook import GRANULARITIES, CompressionHookState, canonical_granularity
from trainscale.compression.exchange import DEFAULT_DENSE_BELOW
from trainscale.errors import ConfigError

log = logging.getLogger("trainscale.compression")

DENSE = "none"
# --flag (config field) -> the compressor's keyword; a flag a method does not take is an error, never ignored
FLAG_PARAMS = {
    "ratio": "ratio",
    "threshold": "threshold",
    "qstates": "qstates",
    "qsgd_bucket": "bucket_size",
    "powersgd_rank": "rank",
}


class CompressionFlags(Protocol):
    """The compression section's fields ``from_config`` reads (``compression.config.CompressionConfig``)."""

    compress: str
    method: str | None
    granularity: str | None
    ratio: float | None
    threshold: float | None
    qstates: int | None
    qsgd_bucket: int | None
    powersgd_rank: int | None
    error_feedback: bool
    compress_warmup_epochs: int
    dense_below: int | None


@dataclass(frozen=True)
class CompressionSpec:
    """Method, its compressor's parameters, granularity, error feedback, dense warm-up epochs and ``dense_below``
    (a layerwise sparsifier's tensors under this many elements, and its 1-D ones, go dense; ``Exchange``).

    ``method == 'none'`` is plain dense fp32. ``params`` are ``create_compressor`` keywords (a rounding
    ``seed`` included where the method takes one); ``text`` leaves the seed out, as it costs nothing.
    """

    method: str = DENSE
    granularity: str = "layerwise"
    params: dict[str, Any] = field(default_factory=dict)
    error_feedback: bool = False
    warmup_epochs: int = 0
    dense_below: int = DEFAULT_DENSE_BELOW

    @property
    def splits_small(self) -> bool:
        """Whether ``dense_below`` applies: a layerwise sparsifier (Top-k, Random-k, Threshold)."""
        return self.granularity == "layerwise" and getattr(compressor_class(self.method), "dense_small", False)

    @property
    def enabled(self) -> bool:
        return self.method != DENSE

    @property
    def dense(self) -> bool:
        return not self.enabled

    @property
    def text(self) -> str:
        """The planner's form, ``METHOD[:key=value,...]`` with sorted keys (how a profile names it)."""
        keys = [f"{k}={v}" for k, v in sorted(self.params.items()) if k != "seed"]
        if self.granularity != "layerwise":
            keys.append(f"granularity={self.granularity}")
        if self.splits_small and self.dense_below != DEFAULT_DENSE_BELOW:
            keys.append(f"dense_below={self.dense_below}")
        return self.method + (":" + ",".join(keys) if keys else "")

    def compressor(self) -> Compressor:
        return create_compressor(self.method, **self.params)

    def without_seed(self) -> CompressionSpec:
        return replace(self, params={k: v for k, v in self.params.items() if k != "seed"})

    def describe(self) -> dict[str, Any]:
        """The summary.json keys of a run's compression."""
        return {
            "compress_method": self.method,
            "compress_granularity": self.granularity,
            "compress_params": self.params,
            "error_feedback": self.error_feedback,
            "compress_warmup_epochs": self.warmup_epochs,
            "dense_below": self.dense_below if self.splits_small else None,
        }

    def hook_state(self, model: nn.Module | None = None, group: Any = None) -> CompressionHookState:
        """The exchange state a DDP hook or a manual reducer runs on (residuals keyed by parameter name)."""
        return CompressionHookState(
            self.compressor(),
            self.granularity,
            model=model,
            error_feedback=self.error_feedback,
            warmup_epochs=self.warmup_epochs,
            group=group,
            dense_below=self.dense_below,
        )

    @classmethod
    def from_config(cls, cfg: CompressionFlags, seed: int | None = None) -> CompressionSpec:
        """Resolve and check the compression flags; errors are one-line ConfigErrors naming the flag."""
        if ":" in cfg.compress:
            raise ConfigError(as_flags_message(cfg.compress))
        named, split = split_compress_flag(cfg.compress)
        method = canonical_method(cfg.method) if cfg.method else (named or DENSE)
        granularity = canonical_granularity(cfg.granularity) if cfg.granularity else (split or "layerwise")
        if named not in (None, DENSE, method):
            raise ConfigError(f"--compress {named} and --method {method} name two methods; give one of them")
        if split not in (None, granularity):
            raise ConfigError(f"--compress {cfg.compress} and --granularity {granularity} disagree; give one of them")
        accepted = compressor_params(method)
        given = {flag: getattr(cfg, flag) for flag in FLAG_PARAMS if getattr(cfg, flag) is not None}
        unused = [f"--{flag.replace('_', '-')}" for flag in given if FLAG_PARAMS[flag] not in accepted]
        if unused:
            takes = [f"--{flag.replace('_', '-')}" for flag, p in FLAG_PARAMS.items() if p in accepted]
            raise ConfigError(
                f"--compress {method} does not use {', '.join(unused)}; it takes: "
                f"{', '.join(takes) or 'none of the compressor flags'}"
            )
        params = {FLAG_PARAMS[flag]: value for flag, value in given.items()}
        if "seed" in accepted and seed is not None:
            params["seed"] = seed
        dense_below = DEFAULT_DENSE_BELOW if cfg.dense_below is None else int(cfg.dense_below)
        spec = cls(method, granularity, params, bool(cfg.error_feedback), int(cfg.compress_warmup_epochs), dense_below)
        spec.compressor()  # bad values fail here, before any worker starts
        if cfg.dense_below is not None and not spec.splits_small:
            raise ConfigError(
                f"--dense-below is for layerwise randomk, topk and threshold (whose per-tensor budget starves small "
                f"tensors); --compress {method} --granularity {granularity} does not use it"
            )
        return spec

    def warn_if_unwise(self) -> None:
        """Log what the settings' own checks cannot refuse but a user should know (once, at validation)."""
        if self.error_feedback and self.compressor().noisy:
            log.warning(
                "--error-feedback with %s: an unbiased stochastic quantiser's error can exceed its input, "
                "and fed back it grows from step to step (training may diverge); leave error feedback off, "
                "or use more levels and smaller buckets",
                self.method,
            )

    @classmethod
    def parse(cls, text: str) -> CompressionSpec:
        """``topk:ratio=0.01[,granularity=entire]``; a bad method, key or value is a one-line ConfigError."""
        name, colon, rest = text.strip().partition(":")
        if colon and not name:
            raise ConfigError(f"--compress {text!r}: no method before the ':'; give METHOD:key=value (topk:ratio=0.01)")
        method = canonical_method(name or DENSE)
        if method not in list_compressors():
            raise ConfigError(f"--compress {text!r}: unknown method {name!r}; known: {', '.join(list_compressors())}")
        params: dict[str, Any] = {}
        granularity = "layerwise"
        dense_below: int | None = None
        seen: set[str] = set()
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise ConfigError(f"--compress {text!r}: {item!r} is not key=value (e.g. topk:ratio=0.01)")
            if key in seen:
                raise ConfigError(f"--compress {text!r}: {key} given twice; give it once")
            seen.add(key)
            if key == "dense_below":
                if not value.isdigit():
                    raise ConfigError(f"--compress {text!r}: dense_below is a number of elements (0: none dense)")
                dense_below = int(value)
                continue
            if key == "granularity":
                if value not in GRANULARITIES:
                    raise ConfigError(f"--compress {text!r}: granularity is one of {', '.join(GRANULARITIES)}")
                granularity = canonical_granularity(value)
                continue
            if key not in compressor_params(method) or key == "seed":
                accepted = [a for a in compressor_params(method) if a != "seed"]
                raise ConfigError(
                    f"--compress {text!r}: {method} takes {', '.join(accepted) or 'no parameters'} "
                    f"and granularity, not {key!r}"
                )
            params[key] = _value(value)
        spec = cls(method, granularity, params, dense_below=DEFAULT_DENSE_BELOW if dense_below is None else dense_below)
        if dense_below is not None and not spec.splits_small:
            raise ConfigError(f"--compress {text!r}: dense_below is for layerwise randomk, topk and threshold")
        try:
            spec.compressor()
        except (TypeError, ValueError) as exc:
            words = [k for k, v in params.items() if isinstance(v, str)]
            hint = f" ({', '.join(words)} must be a number)" if words else ""
            raise ConfigError(f"--compress {text!r}: {exc}{hint}") from None
        return spec


def as_flags_message(text: str) -> str:
    """What to write for a `trainscale plan`-style spec (``topk:ratio=0.01``) given to a run, whose compressor
    parameters are flags: the same spec, its method and each parameter as its flag (the spec checked first)."""
    spec = CompressionSpec.parse(text)
    flag_of = {param: flag for flag, param in FLAG_PARAMS.items()}
    flags = [f"--compress {spec.method}"]
    flags += [f"--{flag_of[k].replace('_', '-')} {v}" for k, v in spec.params.items() if k in flag_of]
    if spec.granularity != "layerwise":
        flags.append(f"--granularity {spec.granularity}")
    if spec.dense_below != DEFAULT_DENSE_BELOW:
        flags.append(f"--dense-below {spec.dense_below}")
    return f"--compress {text!r}: a run takes the method alone and its parameters as flags: {' '.join(flags)}"


def split_compress_flag(value: str) -> tuple[str | None, str | None]:
    """``--compress X``: a granularity (the layer-wise study's meaning) or a method; (method, granularity)."""
    if value.strip().lower() in GRANULARITIES or value.strip().lower() == "entiremodel":
        return None, canonical_granularity(value)
    return canonical_method(value), None


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
