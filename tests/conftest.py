"""Shared fixtures: real services, started once per session where they can be shared."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from transom import log
from transom.broker import EmbeddedBroker

log.setup("INFO")
# The product runs its services at a lower CPU priority (TRANSOM_SERVICE_PRIORITY, transom/priority.py);
# the suite keeps every process at one priority, as its timings were set, unless the variable is given.
# tests/test_priority.py checks the lowering itself.
os.environ.setdefault("TRANSOM_SERVICE_PRIORITY", "normal")
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


# --------------------------------------------------------------------------- InfluxDB

class InfluxServer:
    """A real ``influxd`` (Debian's 1.x package) on 127.0.0.1, with its config and data in ``root``.

    ``url`` is the HTTP API; :meth:`query` runs InfluxQL and returns the decoded JSON ``results``;
    :meth:`create_database` makes a database (the sink writes to an existing one).
    """

    def __init__(self, root: Path) -> None:
        from transom.broker import free_port

        self.root = root
        self.port, self.rpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self, timeout: float = 30.0) -> "InfluxServer":
        import shutil
        import subprocess
        import time
        import urllib.request

        binary = shutil.which("influxd")
        if binary is None:
            pytest.fail("influxd is not installed: the InfluxDB tests need Debian's 'influxdb' package "
                        "(`make test` installs it through `make system-deps`)", pytrace=False)
        conf = self.root / "influxdb.conf"
        conf.write_text(f"""reporting-disabled = true
bind-address = "127.0.0.1:{self.rpc_port}"
[meta]
  dir = "{self.root / 'meta'}"
[data]
  dir = "{self.root / 'data'}"
  wal-dir = "{self.root / 'wal'}"
  query-log-enabled = false
[http]
  bind-address = "127.0.0.1:{self.port}"
  log-enabled = false
[monitor]
  store-enabled = false
[continuous_queries]
  enabled = false
[subscriber]
  enabled = false
[logging]
  level = "warn"
""")
        self.log = open(self.root / "influxd.log", "ab")
        self.proc = subprocess.Popen([binary, "-config", str(conf)], stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/ping", timeout=1) as r:
                    if r.status == 204:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.root / "influxd.log").read_text(errors="replace")[-2000:]
                pytest.fail(f"influxd did not answer on {self.url} within {timeout:.0f}s:\n{tail}", pytrace=False)
            time.sleep(0.1)

    def query(self, q: str, db: str | None = None) -> list[dict]:
        import json
        import urllib.parse
        import urllib.request

        params = {"q": q, "epoch": "ms"}
        if db:
            params["db"] = db
        req = urllib.request.Request(self.url + "/query", data=urllib.parse.urlencode(params).encode())
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["results"]

    def series(self, q: str, db: str) -> list[dict]:
        """The series of a single-statement query; raises on an InfluxQL error."""
        (result,) = self.query(q, db)
        if "error" in result:
            raise AssertionError(f"InfluxQL error for {q!r}: {result['error']}")
        return result.get("series", [])

    def write(self, db: str, lines: str) -> None:
        import urllib.parse
        import urllib.request

        url = f"{self.url}/write?" + urllib.parse.urlencode({"db": db})
        with urllib.request.urlopen(urllib.request.Request(url, data=lines.encode()), timeout=30) as r:
            assert r.status == 204, r.status

    def create_database(self, name: str) -> str:
        (result,) = self.query(f'CREATE DATABASE "{name}"')
        assert "error" not in result, result
        return name

    def stop(self) -> None:
        import signal
        import subprocess

        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "log", None):
            self.log.close()


@pytest.fixture(scope="session")
def influxdb(tmp_path_factory):
    """A real InfluxDB 1.x server (Debian's influxd) on free ports; each test makes its own database."""
    server = InfluxServer(tmp_path_factory.mktemp("influxdb")).start()
    try:
        yield server
    finally:
        server.stop()


# --------------------------------------------------------------------------- test bed

_stale_beds_cleaned: list = []


@pytest.fixture()
def bed():
    """Factory of test beds (transom/testbed.py): ``bed(hosts=2, share=[...]) -> Bed``, up, closed
    after the test. Skips the test, with the one-line reason, where namespaces cannot be made. The
    first use in a session removes beds whose owner died (a killed earlier run)."""
    from tests.util import require_bed
    from transom import testbed

    require_bed()
    if not _stale_beds_cleaned:
        _stale_beds_cleaned.append(testbed.clean_stale())    # what killed runs left, once a session
    made = []

    def make(hosts=2, **kw) -> "testbed.Bed":
        b = testbed.Bed(hosts, **kw).up()
        made.append(b)
        return b

    try:
        yield make
    finally:
        for b in made:
            b.close()
