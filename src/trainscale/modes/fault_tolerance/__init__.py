"""Per-step fault tolerance (``--fault-tolerance``): a data-parallel mode run as torchft replicas, where a dead
worker costs at most one step (sync) or its local steps since the last round (local SGD, DiLoCo).

Everything fault tolerance does lives here, beside the torchft primitives in ``runtime.ft`` (the lighthouse,
each replica's Manager, the start barrier, the fault log: distributed machinery is the runtime layer's):

- ``config``: the ``--fault-tolerance``/``--ft-timeout`` section and its checks;
- ``launcher``: the launcher that hosts the lighthouse and starts one replica agent per worker;
- ``replicated``: the wrappers (``Replicated`` for sync, ``ReplicatedPeriodic`` for local SGD and DiLoCo) and the
  one seam into a run, ``with_fault_tolerance(mode, cfg, job)``; the wrapped modes contain no fault tolerance;
- ``session``: one replica's torchft session (quorum, commit, healing, leaving a finished job);
- ``steps``: the replica's batches and its committing optimizer;
- ``records``: the job's fault record from the replicas' event log.

Each worker is a torchft replica with a world of its own. Every step it joins the quorum (the lighthouse's list
of live replicas), trains on its slice of the step's global batch, averages gradients and BatchNorm running
statistics with the other members through the Manager (a fault-tolerant gloo all-reduce), and applies them only
if the Manager commits the step. A member that dies or hangs makes the step's all-reduce fail: the step is not
applied anywhere (one step lost), the next quorum goes on without it, and when its agent has restarted it, it
heals by copying a live member's whole state (model, optimizer, run state, data position) before its first step.

The run folder: every replica holds a writer (``results.RunWriter``, shared), and at each epoch's end the
quorum's first member writes, re-reading the rows written so far, while the others keep the row; so the record
goes on when the replica that was writing dies, with each epoch once: one elected that died before writing its
row has it written by the next (the rows a replica kept travel with the state a restarted one heals from), and a
restarted replica never rewrites the rows at resume (its checkpoint may be older than what the live ones wrote).

Samples (what the README promises): every replica walks the same per-epoch permutation; the job's data
position counts the per-worker batches of committed steps, and a step with n members trains on the next
n of them, member r on the r-th. So within an epoch no sample is trained on twice by committed steps and
none is skipped while the members stay the same; a step that is not committed leaves the position where
it was, and the next step (with whoever is left) takes those batches again. An epoch ends when fewer
batches are left than members: at most members-1 batches of it go unused, like a partial last batch.
"""

from trainscale.modes.fault_tolerance.config import FT_MODES, ReplicationConfig, validate_fault_tolerance
from trainscale.modes.fault_tolerance.session import (
    JobFinished,
    Position,
    ReplicaSession,
    buckets,
    shared_compression_state,
    unfired,
)
from trainscale.modes.fault_tolerance.steps import CommittingOptimizer, ReplicaBatches

__all__ = [
    "FT_MODES",
    "CommittingOptimizer",
    "JobFinished",
    "Position",
    "ReplicaBatches",
    "ReplicaSession",
    "ReplicationConfig",
    "buckets",
    "shared_compression_state",
    "unfired",
    "validate_fault_tolerance",
]
