"""Named recipes: the training settings a network's source published, found by name.

A recipe is data (config field -> value) plus where it comes from. Every model names its recipe when it registers
(``register_model(..., recipe=NAME)``), and ``app.config.build_config`` puts that recipe between trainscale's
defaults and what the user wrote, so a setting the user leaves unset takes the model's published value rather than
one tuned for another network (ResNet-9's lr 0.4 diverges on ResNet-20). ``--recipe NAME`` picks another one.

A recipe's ``lr`` is meant for its own ``batch_size``: recipes that scale say ``lr_scaling = "linear"`` with
``base_batch_size``, so another ``--batch-size`` gets the learning rate the linear rule gives; an ``--lr`` the user
writes is used as written (the recipe's scaling is dropped with it), and a ``--schedule`` the user writes drops
the recipe's warm-up, milestones and gamma.

This module is a leaf like ``config``: it holds no settings of its own and checks none (the composition root does,
against the config fields); the built-in recipes are registered in ``trainscale.models.recipes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from trainscale.registry import Registry

# Settings that describe another one of the recipe's: dropped with it when the user sets that one.
COMPANIONS = {"lr": ("lr_scaling", "base_batch_size"), "schedule": ("warmup_epochs", "milestones", "gamma")}


@dataclass(frozen=True)
class Recipe:
    """One published way to train: ``settings`` are config fields (``lr``, ``epochs``, ...) and their values."""

    name: str
    source: str
    settings: Mapping[str, Any]
    reference: str | None = None  # a published implementation whose timer scope runs are also reported in

    def for_user(self, user: Mapping[str, Any]) -> dict[str, Any]:
        """The settings that fill what ``user`` left unset. With the user's own ``lr`` the recipe's scaling rule
        goes too (it described the recipe's lr), with the user's own ``schedule`` its warm-up and milestones."""
        drop = set(user)
        for key in set(user) & set(COMPANIONS):
            drop.update(COMPANIONS[key])
        return {k: v for k, v in self.settings.items() if k not in drop}


RECIPES: Registry[Recipe] = Registry("recipe")


def register_recipe(name: str, *, source: str, reference: str | None = None, **settings: Any) -> Recipe:
    """Register the recipe ``name``: settings as config field names (``batch_size``, not ``--batch-size``);
    ``reference``: the implementation whose timer scope a run of this recipe also reports (``reference_scope``)."""
    recipe = Recipe(name, source, MappingProxyType(dict(settings)), reference)
    RECIPES.register(name)(lambda: recipe)
    return recipe


def get_recipe(name: str) -> Recipe:
    """The recipe ``name``; an unknown name is a ConfigError with a did-you-mean hint."""
    return RECIPES.create(name)


def list_recipes() -> list[str]:
    return RECIPES.names()
