"""Scaling efficiency: how much of N workers' ideal speed-up a run achieved against a baseline run.

The figures are read from summaries, so they live with the summary's definitions (``trainscale.record``);
this module keeps the names the engine and earlier code import.
"""

from __future__ import annotations

from trainscale.record import SAME_CONFIG, config_mismatches, scaling_efficiency, throughput

__all__ = ["SAME_CONFIG", "config_mismatches", "scaling_efficiency", "throughput"]
