"""Compressed gradient communication with real wire formats, measured in bytes actually sent.

Compressors (``list_compressors()``): ``none``, ``fp16``, ``bf16``, ``randomk``, ``topk``,
``threshold``, ``terngrad``, ``qsgd``, ``signsgd``, ``efsignsgd``, ``powersgd``, ``dgc``. Each is a
pure ``encode(x, ctx) -> Payload`` / ``decode(payload) -> Tensor`` pair (plus per-parameter state where
the method has any), so DDP hooks, manual reducers and parameter servers share them.

Entry points:

* ``CompressionSpec``: the one description of a run's compression (method, parameters, granularity, error
  feedback, warm-up), read once from the flags or the planner's text; every user below builds from it.
* ``make_reducer(model, method, granularity, error_feedback=..., **params)``: what a training loop
  calls (hook for DDP models, manual ``.reduce()`` after backward otherwise).
* ``CompressionHookState`` + ``compression_hook``: the standard DDP comm hook for your own loop.
* ``Exchange``: compress, exchange and average a list of tensors with torch.distributed.
"""

from trainscale.compression import methods  # noqa: F401  (registers every compressor)
from trainscale.compression.base import (
    COMPRESSORS,
    Compressor,
    Payload,
    UnitContext,
    canonical_method,
    compressor_params,
    create_compressor,
    list_compressors,
)
from trainscale.compression.ddp_hook import (
    GRANULARITIES,
    CompressionHookState,
    canonical_granularity,
    compression_hook,
    ddp_kwargs_for,
)
from trainscale.compression.exchange import Exchange
from trainscale.compression.feedback import ErrorFeedback
from trainscale.compression.reducer import HookReducer, ManualReducer, Reducer, make_reducer
from trainscale.compression.spec import FLAG_PARAMS, CompressionSpec
from trainscale.compression.stats import CompressionStats

__all__ = [
    "COMPRESSORS",
    "GRANULARITIES",
    "CompressionHookState",
    "CompressionSpec",
    "CompressionStats",
    "Compressor",
    "ErrorFeedback",
    "FLAG_PARAMS",
    "Exchange",
    "HookReducer",
    "ManualReducer",
    "Payload",
    "Reducer",
    "UnitContext",
    "canonical_granularity",
    "canonical_method",
    "compression_hook",
    "compressor_params",
    "create_compressor",
    "ddp_kwargs_for",
    "list_compressors",
    "make_reducer",
]
