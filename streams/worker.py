"""A Faust worker whose shutdown on a signal cannot hang, shared by the TEE and the sink.

Faust's own shutdown waits for the broker, which may be the very thing that is gone; a
:class:`BoundedWorker` exits ``STOP_GRACE`` seconds after SIGINT/SIGTERM whatever happens.
"""

from __future__ import annotations

import logging
import os
import threading

import faust

from transom.log import get

__all__ = ["BoundedWorker", "STOP_GRACE"]

log = get("streams.worker")

#: Seconds a worker may take to stop after SIGINT/SIGTERM before it exits anyway.
STOP_GRACE = 15.0


class BoundedWorker(faust.Worker):
    """``faust.Worker`` that exits ``STOP_GRACE`` s after a stop signal; ``service`` names it in logs."""

    service = "worker"

    def _arm(self, signame: str) -> None:
        def deadline() -> None:
            log.warning("%s did not stop within %gs of %s (broker gone?): exiting now", self.service, STOP_GRACE,
                        signame)
            logging.shutdown()
            os._exit(0)

        timer = threading.Timer(STOP_GRACE, deadline)
        timer.daemon = True
        timer.start()

    def _on_sigterm(self) -> None:
        self._arm("SIGTERM")
        super()._on_sigterm()

    def _on_sigint(self) -> None:
        self._arm("SIGINT")
        super()._on_sigint()
