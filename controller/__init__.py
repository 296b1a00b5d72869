"""TOL, the controller: job state machine, event-sourced state, backends.

Exception tree::

    IllegalTransition(RuntimeError)   a decision broke the transition table (a bug, not a user error)
"""

from .backend import Backend, RankStatus, create_backend, register_backend
from .local import LocalBackend
from .service import Controller, replay
from .state import FAULT_POLICY, IllegalTransition, Job, JobSpec, JobState, decide

__all__ = ["Backend", "RankStatus", "create_backend", "register_backend", "LocalBackend", "Controller",
           "replay", "FAULT_POLICY", "IllegalTransition", "Job", "JobSpec", "JobState", "decide"]
