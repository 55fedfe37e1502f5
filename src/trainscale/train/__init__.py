"""The training engine: the step and the epoch loop, evaluation, schedules, checkpoints and the run folder.

It knows no mode, launcher or report: a mode reaches it as one ``Callbacks`` object, and the composition
root (``trainscale.app``) builds the pieces. From Python::

    from trainscale.train import build_model, build_optimizer, train_step
"""

from trainscale.train.callbacks import Callbacks
from trainscale.train.loop import PassStats, evaluate, train_one_epoch, train_step
from trainscale.train.optimizers import build_optimizer
from trainscale.train.setup import BatchPlan, build_model, built_model, load_data
from trainscale.train.trainer import Trainer

__all__ = [
    "BatchPlan",
    "Callbacks",
    "PassStats",
    "Trainer",
    "build_model",
    "built_model",
    "build_optimizer",
    "evaluate",
    "load_data",
    "train_one_epoch",
    "train_step",
]
