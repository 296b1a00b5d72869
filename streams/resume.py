"""What a starting TEE worker must know of its predecessors: the fault events already sent.

:func:`emitted_faults` reads ``transom.faults`` from its beginning (no consumer group) and returns
the valid events; :meth:`transom.streams.engine.TEEEngine.restore` takes them, so that batches the
worker sees again (Faust commits offsets every few seconds; a killed worker's successor starts
from the last commit) yield no fault a second time. Malformed values are skipped here: they are
not this worker's input (the controller dead-letters them).

Cost: the whole faults topic once per start; it holds only faults, a small topic next to the
metrics (its retention bounds it).
"""

from __future__ import annotations

from transom import contracts
from transom.kafka import read_topic
from transom.log import get

__all__ = ["emitted_faults"]

log = get("tee")


def emitted_faults(bootstrap: str, timeout: float = 30.0) -> list[contracts.FaultEvent]:
    """Every valid :class:`~transom.contracts.FaultEvent` now on ``transom.faults``.

    If the topic cannot be read, says so and returns what it read: the worker then runs without
    that memory (a fault it sees again is sent again, with the same id, for the controller to drop).
    """
    out = []
    try:
        for _key, value, _p, _o in read_topic(bootstrap, contracts.FAULTS, timeout=timeout):
            try:
                out.append(contracts.decode(contracts.FAULTS, value))
            except contracts.ContractError:
                continue
    except Exception as exc:   # BrokerUnavailable, KafkaException: not a reason not to start
        log.warning("could not read %s to learn the faults already sent (%s); faults this worker sees "
                    "again may be sent twice (same id)", contracts.FAULTS, exc)
    return out
