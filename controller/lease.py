"""One active controller at a time: a lease written as events in ``transom.lifecycle``.

The lifecycle topic has one partition, so every controller reads the same total order of events.
A lease event (job key :data:`LEASE_KEY`, name ``lease``) carries a ``term`` and a ``holder``:

- the *first* lease event of term ``T + 1`` in the log wins term ``T + 1``; later claims of the
  same term lose, and a controller that reads a term above its own stops acting (fencing);
- the holder renews every ``renew_s`` seconds from a background thread (so a long action does not
  let the lease lapse); a standby that reads no renewal for ``duration_s`` claims the next term;
- a holder that exits cleanly writes a release, so a standby takes over at once;
- a holder whose renewals are not acknowledged by the broker for ``duration_s`` counts itself as
  having lost the lease (another controller may hold it by then).

Lease events have an empty snapshot, so :func:`transom.controller.service.replay` skips them.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from transom import contracts
from transom.kafka import QUIET_FETCH_WAIT_MS, client_config, make_producer, publish
from transom.log import get

__all__ = ["Lease", "LeaseLost", "LEASE_KEY", "current_holder"]

log = get("controller.lease")
LEASE_KEY = "__controller__"


class LeaseLost(RuntimeError):
    """Another controller holds the lease now; this one must not act any more."""


class Lease:
    def __init__(self, bootstrap: str, holder: str | None = None, *, duration_s: float = 3.0,
                 renew_s: float = 1.0) -> None:
        self.bootstrap = bootstrap
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}"
        self.duration_s = duration_s
        self.renew_s = renew_s
        self.producer = make_producer(bootstrap, linger_ms=0)
        self.consumer = Consumer(client_config(bootstrap, group_id="transom-controller-lease", enable_auto_commit=False,
                                               enable_partition_eof=True, fetch_wait_max_ms=QUIET_FETCH_WAIT_MS))
        self.consumer.assign([TopicPartition(contracts.LIFECYCLE, 0, OFFSET_BEGINNING)])
        self.term = 0                    # newest term seen in the log
        self.term_holder = ""            # who won it
        self.seen_mono = 0.0             # local time of the newest renewal of the current term
        self.released = True             # the current term's holder released it
        self.my_term = 0
        self.lost = threading.Event()
        self._last_ack = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._caught_up = False

    # ------------------------------------------------------------------ reading the log
    def _poll(self, timeout: float) -> None:
        msg = self.consumer.poll(timeout)
        if msg is None:
            return
        if msg.error():
            if msg.error().code() == KafkaError._PARTITION_EOF:
                self._caught_up = True
            return
        if msg.key() != LEASE_KEY.encode():
            return
        try:
            ev = contracts.decode(contracts.LIFECYCLE, msg.value())
        except contracts.ContractError:
            return
        term, holder = int(ev.detail.get("term", 0)), str(ev.detail.get("holder", ""))
        age = max(time.time() - ev.ts, 0.0)
        if term > self.term:
            self.term, self.term_holder = term, holder
            self.seen_mono, self.released = time.monotonic() - age, ev.state == "released"
            if self.my_term and term > self.my_term:
                log.error("controller %s holds the lease now (term %d): this controller (%s) stops acting",
                          holder, term, self.holder)
                self.lost.set()
        elif term == self.term and holder == self.term_holder:
            self.seen_mono, self.released = time.monotonic() - age, ev.state == "released"

    def _write(self, state: str, term: int) -> None:
        def acked(err, _msg):
            if err is None:
                self._last_ack = time.monotonic()

        ev = contracts.LifecycleEvent(job=LEASE_KEY, seq=term, ts=time.time(), name="lease", state=state,
                                      detail={"term": term, "holder": self.holder, "duration_s": self.duration_s})
        publish(self.producer, contracts.LIFECYCLE, LEASE_KEY, ev, on_delivery=acked)
        self.producer.poll(0)

    def expired(self) -> bool:
        return self.released or time.monotonic() - self.seen_mono > self.duration_s

    # ------------------------------------------------------------------ acquiring
    def acquire(self, stopping: threading.Event, idle: Callable[[], None] = lambda: None) -> bool:
        """Block until this controller holds the lease (True) or ``stopping`` is set (False).

        ``idle`` is called between polls, so a standby keeps its other inputs (metrics) warm.
        """
        announced = False
        deadline = time.monotonic() + 10
        while not self._caught_up and time.monotonic() < deadline and not stopping.is_set():
            self._poll(0.1)
        while not stopping.is_set():
            self._poll(0.1)
            idle()
            if not self.expired():
                if not announced:
                    log.info("standby: controller %s holds the lease (term %d); waiting for it to lapse",
                             self.term_holder, self.term)
                    announced = True
                continue
            claim = self.term + 1
            self._write("held", claim)
            if self.producer.flush(10):
                log.warning("could not write a lease claim; retrying")
                continue
            until = time.monotonic() + 10
            while self.term < claim and time.monotonic() < until:
                self._poll(0.1)
            if self.term == claim and self.term_holder == self.holder:
                self.my_term = claim
                self._last_ack = time.monotonic()
                log.info("controller %s holds the lease (term %d)", self.holder, claim)
                self._thread = threading.Thread(target=self._renew, name="lease", daemon=True)
                self._thread.start()
                return True
            log.info("lost the claim for term %d to %s", claim, self.term_holder)
        return False

    def _renew(self) -> None:
        next_renew = 0.0
        while not self._stop.is_set() and not self.lost.is_set():
            now = time.monotonic()
            if now >= next_renew:
                self._write("held", self.my_term)
                next_renew = now + self.renew_s
            self.producer.poll(0)
            self._poll(0.1)
            if time.monotonic() - self._last_ack > self.duration_s:
                log.error("lease renewals not acknowledged for %.1fs: this controller stops acting", self.duration_s)
                self.lost.set()

    def check(self) -> None:
        if self.lost.is_set():
            raise LeaseLost(f"controller {self.holder} lost the lease (term {self.my_term}) to {self.term_holder} "
                            f"(term {self.term})")

    def release(self) -> None:
        """Stop renewing; if still the holder, write a release so a standby takes over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.my_term and not self.lost.is_set():
            self._write("released", self.my_term)
            self.producer.flush(5)
        self.consumer.close()


def current_holder(bootstrap: str) -> tuple[str, float] | None:
    """``(holder, seconds since its newest renewal)`` of the controller holding the lease now, or None
    (no lease event, released, or not renewed within its duration)."""
    from transom.kafka import read_topic

    newest = None
    for key, value, _p, _o in read_topic(bootstrap, contracts.LIFECYCLE):
        if key == LEASE_KEY.encode():
            try:
                newest = contracts.decode(contracts.LIFECYCLE, value)
            except contracts.ContractError:
                continue
    if newest is None or newest.state == "released":
        return None
    age = max(time.time() - newest.ts, 0.0)
    if age > float(newest.detail.get("duration_s", 3.0)) + 1.0:
        return None
    return str(newest.detail.get("holder", "?")), age
