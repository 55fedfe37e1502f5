"""Training: config, schedules, the hot loop, the epoch loop, checkpoints and the run folder."""

from trainscale.train.config import TrainConfig, build_config, load_toml
from trainscale.train.run import run_training

__all__ = ["TrainConfig", "build_config", "load_toml", "run_training"]
