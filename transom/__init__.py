"""Transom: keeps large training jobs running through hardware and software faults.

Components (each installed under this namespace from its top-level folder):

- ``transom.agents``     node agent: collectors, training intake, publisher (agents/)
- ``transom.streams``    TEE, fault detection as a Faust app (streams/)
- ``transom.controller`` TOL, the job controller and its backends (controller/)
- ``transom.checkpoint`` TCE, the checkpoint engine (checkpoint/)

Shared by all of them: ``transom.contracts`` (topics and event types), ``transom.config``
(settings), ``transom.kafka`` (clients and topic creation), ``transom.broker`` (the embedded
broker used by the demo and the tests).
"""

__version__ = "0.1.0"
