"""The optimizer of a run over named parameter groups: SGD, Muon on the conv filters with SGD on the rest (both
registered here), or any other optimizer of the registry (``train.optim``: AdamW, LARS, LAMB...).

Groups, in this order (the first is the one whose lr the per-epoch table shows):
- ``rest``: everything not below, at ``--lr``;
- ``head``: the classifier (the model's last ``nn.Linear``), at ``--lr`` x ``--head-lr-factor``, its weight decay
  divided by the factor so that lr x weight decay, the decay per step, is the same as in ``rest`` (airbench94);
- one group per parameter the model trains only at first (``model.train_until``: name -> epochs), its lr falling
  linearly from the base lr to zero by then and staying there (airbench94's whitening bias);
- ``no_decay`` and ``head_no_decay``: with ``--no-decay-norm-bias``, the 1-D parameters (biases, normalisation
  weights) of ``rest`` and ``head``, without weight decay and without LARS/LAMB's trust ratio (``trust_ratio``);
- ``filters``: with ``--optimizer muon``, every 4-D conv weight, updated by Muon at ``--muon-lr``
  (``train.muon.BatchedMuon``: torch.optim.Muon's update, batched over the filters).

Each group carries ``lr_scale`` (its lr over the schedule's) or ``until_epoch``; :func:`set_lr` applies them every
step. Muon takes 2-D matrices: it is given views of the filters in their memory order (Muon's orthogonalised
update does not depend on the order of the columns), so it updates the model's weights and the momentum buffers
held in this optimizer's state in place, and a checkpoint of this optimizer holds everything.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.sgd import sgd as sgd_update

from trainscale.config import CoreConfig, OptimConfig
from trainscale.train.muon import BatchedMuon, iteration_dtype, muon_plan
from trainscale.train.optim import create_optimizer, register_optimizer
from trainscale.train.optim.registry import OPTIMIZER_SETTINGS

MUON_NS_STEPS = 3  # airbench94_muon's Newton-Schulz iterations (torch's default is 5)


def build_optimizer(cfg: CoreConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The configured optimizer over ``model``'s trainable parameters, grouped as the module docstring says
    (any optimizer of the registry, ``train.optim``, or one named by import path)."""
    optimizer = create_optimizer(parameter_groups(cfg, model, lr), cfg.optim)
    if isinstance(optimizer, MuonWithSGD):
        optimizer.normalise_filters = has_batchnorm(model)
    return optimizer


@register_optimizer("sgd", reads=("momentum", "nesterov"))
def sgd(groups: list[dict[str, Any]], cfg: OptimConfig, args: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)


@register_optimizer("muon", reads=OPTIMIZER_SETTINGS)
def muon(groups: list[dict[str, Any]], cfg: OptimConfig, args: dict[str, Any]) -> torch.optim.Optimizer:
    device = next(p.device for g in groups for p in g["params"])
    sgd_args = dict(momentum=cfg.momentum, nesterov=cfg.nesterov)
    return MuonWithSGD(groups, sgd_args, normalise_filters=False, muon_plan=muon_plan(cfg.muon_compile, device))


def parameter_groups(cfg: CoreConfig, model: nn.Module, lr: float) -> list[dict[str, Any]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    until = getattr(model, "train_until", {})
    head = {id(p) for p in head_parameters(model)} if cfg.optim.head_lr_factor != 1 else set()
    muon = cfg.optim.optimizer == "muon"
    exempt = cfg.optim.no_decay_norm_bias
    placed: dict[str, list[nn.Parameter]] = {"rest": [], "head": [], "filters": [], "no_decay": [], "head_no_decay": []}
    groups: list[dict[str, Any]] = []
    for name, p in named:
        if name in until:
            groups.append(group("until", [p], lr, cfg.optim.weight_decay, until_epoch=float(until[name])))
        elif muon and p.ndim == 4:
            placed["filters"].append(p)
        elif id(p) in head:
            placed["head_no_decay" if exempt and p.ndim <= 1 else "head"].append(p)
        else:
            placed["no_decay" if exempt and p.ndim <= 1 else "rest"].append(p)
    factor = cfg.optim.head_lr_factor
    return [
        g
        for g in (
            group("rest", placed["rest"], lr, cfg.optim.weight_decay),
            group("head", placed["head"], lr * factor, cfg.optim.weight_decay / factor, lr_scale=factor),
            group("no_decay", placed["no_decay"], lr, 0.0, trust_ratio=False),
            group("head_no_decay", placed["head_no_decay"], lr * factor, 0.0, lr_scale=factor, trust_ratio=False),
            *groups,
            group(
                "filters",
                placed["filters"],
                cfg.optim.muon_lr,
                0.0,
                lr_scale=cfg.optim.muon_lr / lr if lr else 0.0,
                muon=True,
                momentum=cfg.optim.muon_momentum,
            ),
        )
        if g["params"]
    ]


def group(name: str, params: list[nn.Parameter], lr: float, weight_decay: float, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "params": params,
        "lr": lr,
        "weight_decay": weight_decay,
        "peak_lr": lr,
        "lr_scale": 1.0,
        **extra,
    }


def head_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of the model's last ``nn.Linear`` (its classifier), or none."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return [p for p in linears[-1].parameters() if p.requires_grad] if linears else []


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def set_lr(optimizer: torch.optim.Optimizer, lr: float, epoch: float) -> None:
    """Every group's lr for the schedule's ``lr`` at fractional ``epoch`` (see the module docstring)."""
    for g in optimizer.param_groups:
        until = g.get("until_epoch")
        value = g["peak_lr"] * max(0.0, 1.0 - epoch / until) if until else lr * g.get("lr_scale", 1.0)
        if isinstance(g["lr"], torch.Tensor):  # a compiled step's (train.step.tensor_lrs): filled, not replaced
            g["lr"].fill_(value)
        else:
            g["lr"] = value


def matrix(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` (a filter's shape) as (out, in x kh x kw) in the memory order of ``like``: a view when
    ``tensor`` is laid out like ``like``, a copy otherwise."""
    order = (0, 1, 2, 3) if like.is_contiguous() else (0, 2, 3, 1)
    return tensor.permute(order).reshape(tensor.shape[0], -1)


class MuonWithSGD(torch.optim.Optimizer):
    """One optimizer to the trainer (checkpoints, modes, schedules): batched Muon for the group marked
    ``muon`` and SGD (``torch.optim.SGD``'s functional form) for the others.

    ``normalise_filters``: before each step every filter is rescaled to norm sqrt(out channels), as airbench94_muon
    does; a BatchNorm after the conv makes the scale irrelevant to the output, and fixing it keeps Muon's
    fixed-size steps at a fixed relative size. Only for models with BatchNorm (elsewhere the scale matters)."""

    def __init__(
        self,
        groups: Iterable[dict[str, Any]],
        sgd: dict[str, Any],
        normalise_filters: bool,
        muon_plan: tuple[str, bool] = ("shape", False),
    ) -> None:
        super().__init__(list(groups), dict(muon=False, **sgd))
        self.normalise_filters = normalise_filters
        self.muon_plan = muon_plan
        self.ns_dtype: torch.dtype | None = None  # Muon's iteration; None: the device's (``iteration_dtype``)
        self._muons: dict[tuple[tuple[int, ...], ...], BatchedMuon] = {}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            if params:
                (self._muon_step if g["muon"] else self._sgd_step)(g, params)
        return loss

    def _sgd_step(self, g: dict[str, Any], params: list[torch.Tensor]) -> None:
        buffers = [self.state[p].get("momentum_buffer") for p in params]
        grads = [p.grad for p in params if p.grad is not None]
        sgd_update(
            params,
            grads,
            buffers,
            weight_decay=g["weight_decay"],
            momentum=g["momentum"],
            lr=g["lr"],
            dampening=0.0,
            nesterov=g["nesterov"],
            maximize=False,
        )
        for p, buffer in zip(params, buffers):
            self.state[p]["momentum_buffer"] = buffer

    def _muon_step(self, g: dict[str, Any], params: list[torch.Tensor]) -> None:
        if self.normalise_filters:
            norms = torch._foreach_norm(params)
            torch._foreach_mul_(params, [math.sqrt(p.shape[0]) / n.clamp_min(1e-12) for p, n in zip(params, norms)])
        views = [matrix(p, p) for p in params]
        grads = [matrix(p.grad, p) for p in params if p.grad is not None]
        buffers = [self._buffer_view(p) for p in params]
        self._muon_for(params, views).step(views, grads, buffers, g["lr"], g["momentum"], nesterov=True)

    def prepare(self) -> None:
        """Plan (and compile where asked) the batched Muon of the filters that have gradients now, before a
        compiled step first runs: planning checks the filters' memory layout, which a compiled step cannot trace
        without splitting its graph there."""
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            if g["muon"] and params:
                self._muon_for(params, [matrix(p, p) for p in params])

    def _muon_for(self, params: list[torch.Tensor], views: list[torch.Tensor]) -> BatchedMuon:
        """The batched Muon for these filters' shapes (planned, and compiled where asked, once)."""
        key = tuple(tuple(v.shape) for v in views)
        if key not in self._muons:
            for p, view in zip(params, views):
                if view.data_ptr() != p.data_ptr():
                    raise ValueError(f"filter of shape {tuple(p.shape)} is neither contiguous nor channels_last")
            stacking, compiled = self.muon_plan
            dtype = self.ns_dtype or iteration_dtype(params[0].device)
            muon = BatchedMuon(list(key), MUON_NS_STEPS, stacking=stacking, compile=compiled, ns_dtype=dtype)
            self._muons[key] = muon
        return self._muons[key]

    def _buffer_view(self, p: torch.Tensor) -> torch.Tensor:
        """The momentum buffer of ``p`` as a view Muon updates in place; laid out like ``p`` (a loaded checkpoint
        may hold it in another layout)."""
        state = self.state[p]
        buffer = state.get("momentum_buffer")
        if buffer is None or buffer.stride() != p.stride():
            state["momentum_buffer"] = torch.zeros_like(p) if buffer is None else torch.empty_like(p).copy_(buffer)
        return matrix(state["momentum_buffer"], p)
