"""TOL, the controller: job state machine, event-sourced state, lease, pre-check, backends.

Exception tree::

    IllegalTransition(RuntimeError)   a decision broke the transition table (a bug, not a user error)
    LeaseLost(RuntimeError)           another controller holds the lease; this one stops acting
    SlurmError(RuntimeError)          a Slurm command failed (its output is in the message)

Backends register by name (``local``, ``hosts``, ``kubernetes``, ``slurm``); the last three are
imported on demand (``transom.controller.kubernetes`` needs the ``kubernetes`` package). The hosts
backend talks to node launchers over :mod:`transom.channel` (its own exception tree:
``ChannelError`` and ``Unreachable``, ``Refused``, ``RemoteError``).
"""

from .backend import Backend, RankStatus, create_backend, register_backend
from .health import HealthBook
from .lease import Lease, LeaseLost
from .local import LocalBackend
from .service import Controller, PrecheckConfig, replay
from .state import (FAULT_POLICY, RECOVERY_STEPS, TRANSITIONS, IllegalTransition, Job, JobSpec, JobState,
                    RecoveryStep, decide, pending_actions)

__all__ = ["Backend", "RankStatus", "create_backend", "register_backend", "HealthBook", "Lease", "LeaseLost",
           "LocalBackend", "Controller", "PrecheckConfig", "replay", "FAULT_POLICY", "RECOVERY_STEPS",
           "TRANSITIONS", "IllegalTransition", "Job", "JobSpec", "JobState", "RecoveryStep", "decide",
           "pending_actions"]
