"""One log format for every Transom service: ``time level component message key=value ...``."""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["setup", "get"]

_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s"
_DATEFMT = "%Y-%m-%dT%H:%M:%S"


def setup(level: str | None = None, stream=None) -> None:
    """Configure the root logger once (level from ``TRANSOM_LOG_LEVEL``, default INFO)."""
    level = (level or os.environ.get("TRANSOM_LOG_LEVEL") or "INFO").upper()
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, _DATEFMT))
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("aiokafka", "faust", "mode", "kafka", "numba"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def get(component: str) -> logging.Logger:
    return logging.getLogger(f"transom.{component}")
