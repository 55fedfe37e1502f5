"""Optimizers found by name, or by import path (``package.module:factory``), with their own keyword arguments.

An optimizer is one factory registered with ``@register_optimizer(NAME, lr=..., weight_decay=...)``: it takes the
parameter groups (``optimizers.parameter_groups``: each group's ``lr`` and ``weight_decay`` already set), the
config's optimisation section and the ``--optim-arg`` keywords, and returns a ``torch.optim.Optimizer``. The
keywords it accepts are those of ``accepts`` (by default the signature of the class it names), less the ones a
trainscale flag owns (``--lr``, ``--weight-decay``, ``--momentum``, ``--nesterov``). The ``lr`` and
``weight_decay`` given at registration are the optimizer's own defaults: a recipe tuned for SGD does not hand its
learning rate to Adam (``app.config.with_recipe``).

An import path names a ``torch.optim.Optimizer`` subclass or a function of the groups, called as
``target(groups, **optim_args)``, with ``momentum=`` and ``nesterov=`` (``--momentum``, ``--nesterov``) where its
signature names them; its other keywords are its signature's.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from trainscale.config import OptimConfig
from trainscale.errors import ConfigError
from trainscale.registry import Registry

Factory = Callable[[list[dict[str, Any]], OptimConfig, dict[str, Any]], torch.optim.Optimizer]
OWNED = {
    "lr": "--lr",
    "weight_decay": "--weight-decay",
    "momentum": "--momentum",
    "nesterov": "--nesterov",
    "params": "the model",
}


@dataclass(frozen=True)
class OptimizerInfo:
    """What the registry knows of one optimizer besides its factory."""

    name: str
    factory: Factory
    accepts: tuple[str, ...] = ()  # its --optim-arg keywords
    defaults: Mapping[str, Any] = field(default_factory=dict)  # lr / weight_decay for a recipe made for another one
    reads: tuple[str, ...] = ()  # the settings of OPTIMIZER_SETTINGS it reads


OPTIMIZERS: Registry[torch.optim.Optimizer] = Registry("optimizer")
OPTIMIZER_SETTINGS = ("momentum", "nesterov", "muon_lr", "muon_momentum", "muon_compile")  # read by some only
SHARED_WITH_SGD = ("momentum", "nesterov")  # passed to an optimizer by import path whose signature names them


def register_optimizer(
    name: str, *, accepts: Iterable[str] | type | None = None, reads: Iterable[str] = (), **defaults: Any
) -> Callable[[Factory], Factory]:
    """Register ``factory`` under ``name``; ``accepts``: its keyword names, or the class whose signature lists them;
    ``reads``: which of ``OPTIMIZER_SETTINGS`` it uses (a note says when one given does nothing)."""
    keys = keywords_of(accepts) if isinstance(accepts, type) else tuple(accepts or ())
    return OPTIMIZERS.register(name, accepts=keys, defaults=dict(defaults), reads=tuple(reads))


def keywords_of(cls: type) -> tuple[str, ...]:
    """The keyword arguments ``cls(params, ...)`` takes, less those a flag owns."""
    params = inspect.signature(cls).parameters
    return tuple(n for n, p in params.items() if n not in OWNED and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def is_import_path(name: str) -> bool:
    return ":" in name


def optimizer_info(name: str) -> OptimizerInfo:
    """The registered optimizer ``name`` (ConfigError with a did-you-mean), or the one an import path names: a
    ``torch.optim.Optimizer`` subclass or a function, called as ``target(groups, **optim_args)`` (the groups hold
    each one's lr and weight decay); its keywords are its signature's."""
    if is_import_path(name):
        target = import_object(name)
        keys = keywords_of(target) if isinstance(target, type) else _function_keywords(target)
        return OptimizerInfo(name, _imported_factory(target), keys, reads=_shared_with_sgd(target))
    entry = OPTIMIZERS.get(name)
    return OptimizerInfo(name, entry.factory, entry.meta["accepts"], entry.meta["defaults"], entry.meta["reads"])


def _shared_with_sgd(target: Any) -> tuple[str, ...]:
    return tuple(n for n in SHARED_WITH_SGD if n in inspect.signature(target).parameters)


def _imported_factory(target: Any) -> Factory:
    """``target(groups, **args)`` plus the flags it shares with SGD that its signature names (``--momentum``,
    ``--nesterov``), so a run records what it trained with."""
    shared = _shared_with_sgd(target)

    def build(groups: list[dict[str, Any]], cfg: OptimConfig, args: dict[str, Any]) -> torch.optim.Optimizer:
        return target(groups, **{n: getattr(cfg, n) for n in shared}, **args)

    return build


def _function_keywords(target: Any) -> tuple[str, ...]:
    if not callable(target):
        raise ConfigError(f"--optimizer: {target!r} is not a class or function")
    params = list(inspect.signature(target).parameters.items())[1:]  # after the groups
    return tuple(n for n, p in params if n not in OWNED and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def import_object(path: str) -> Any:
    """``package.module:attribute``, imported (one line naming the path and the error when it cannot be)."""
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"--optimizer {path}: cannot import it ({type(exc).__name__}: {exc}); give a registered name "
            f"({', '.join(OPTIMIZERS.names())}) or package.module:factory importable here (PYTHONPATH)"
        ) from None


def parse_optim_args(items: Iterable[str], info: OptimizerInfo) -> dict[str, Any]:
    """``--optim-arg KEY=VALUE`` items as keywords: numbers, true/false, none, and comma lists as tuples;
    a key the optimizer does not take, or one a flag owns, is one line saying which keys it takes."""
    args: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"--optim-arg {item!r}: expected KEY=VALUE, e.g. --optim-arg betas=0.9,0.95")
        if key in OWNED:
            raise ConfigError(f"--optim-arg {key}: set it with {OWNED[key]}, not --optim-arg")
        if key not in info.accepts:
            takes = ", ".join(info.accepts) or "none"
            raise ConfigError(f"--optim-arg {key}: --optimizer {info.name} takes no such argument (it takes: {takes})")
        args[key] = parse_value(text.strip())
    return args


def parse_value(text: str) -> Any:
    """A value as written on the command line: ``0.9,0.95`` is a tuple, ``true``/``false``/``none`` as named."""
    if "," in text:
        return tuple(parse_value(part.strip()) for part in text.split(",") if part.strip())
    words = {"true": True, "false": False, "none": None}
    if text.lower() in words:
        return words[text.lower()]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def create_optimizer(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer ``cfg.optimizer`` names over ``groups``, with ``cfg.optim_arg``'s keywords."""
    info = optimizer_info(cfg.optimizer)
    optimizer = info.factory(groups, cfg, parse_optim_args(cfg.optim_arg, info))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"--optimizer {cfg.optimizer} returned {type(optimizer).__name__}, not a torch.optim.Optimizer; "
            "return an optimizer over the parameter groups it is given"
        )
    return optimizer


def check_optimizer(cfg: OptimConfig) -> None:
    """A bad name, key or value is one line before any data or worker. The optimizer is built on one small
    tensor (its own checks speak: ``Invalid beta parameter at index 0: 1.5``) only where something the config's
    own checks do not cover is given: ``--optim-arg`` keywords, or an optimizer named by import path. A
    registered optimizer with only the flags it shares (``--lr``, ``--momentum``...) needs no build, and the build
    costs the launcher about a second (torch imports its compiler at the first optimizer)."""
    optimizer_info(cfg.optimizer)
    if not cfg.optim_arg and not is_import_path(cfg.optimizer):
        return
    param = torch.nn.Parameter(torch.zeros(2, 2))
    groups = [{"params": [param], "lr": cfg.lr, "weight_decay": cfg.weight_decay}]
    try:
        create_optimizer(groups, cfg)
    except ConfigError:
        raise
    except (ValueError, TypeError, RuntimeError) as exc:
        args = " ".join(f"--optim-arg {a}" for a in cfg.optim_arg)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = (
            "; check each value's type (several numbers are written 0.9,0.999)"
            if cfg.optim_arg and isinstance(exc, TypeError)
            else ""
        )
        raise ConfigError(f"--optimizer {cfg.optimizer} {args}: {reason}{hint}".replace("  ", " ")) from None


def list_optimizers() -> list[str]:
    return OPTIMIZERS.names()
