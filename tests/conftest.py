"""Shared fixtures: real services, started once per session where they can be shared."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from transom import log
from transom.broker import EmbeddedBroker

log.setup("INFO")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    """A real Kafka-protocol broker (embedded Tansu) with Transom's topics created."""
    logfile = tmp_path_factory.mktemp("broker") / "broker.log"
    with EmbeddedBroker(log_path=str(logfile)) as b:
        yield b


@pytest.fixture()
def fresh_broker(tmp_path):
    """A broker of the test's own, for tests that need empty topics or kill the broker."""
    with EmbeddedBroker(log_path=str(tmp_path / "broker.log")) as b:
        yield b


@pytest.fixture()
def transom_env(broker):
    """Environment for subprocesses that talk to the session broker."""
    env = dict(os.environ)
    env["TRANSOM_BOOTSTRAP"] = broker.bootstrap
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TRANSOM_LOG_LEVEL", "INFO")
    return env


def python() -> str:
    return sys.executable
