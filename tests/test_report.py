"""`transom report`: one self-contained HTML file from the topics, rendered by headless Chromium."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from test_sink import publish_all, run_events

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0", "--hide-scrollbars"]


def chromium_console(page: Path, screenshot: Path, size: str = "1100,2600", min_bytes: int = 50_000) -> list[str]:
    """Render ``page`` in Debian's headless Chromium; return its console messages (errors included)."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.fail("chromium is not installed: the report test renders the report in Debian's chromium "
                    "(apt-get install chromium; `make system-deps` installs it)", pytrace=False)
    with tempfile.TemporaryDirectory(prefix="transom-chromium-") as profile:
        proc = subprocess.run([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size}",
                               f"--screenshot={screenshot}", page.resolve().as_uri()],
                              capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert screenshot.exists() and screenshot.stat().st_size > min_bytes, "no screenshot written"
    return [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]


@pytest.fixture(scope="module")
def report_file(tmp_path_factory):
    """A report written by `transom report` from a run's events on a broker of its own."""
    from transom.broker import EmbeddedBroker

    tmp = tmp_path_factory.mktemp("report")
    with EmbeddedBroker(log_path=str(tmp / "broker.log")) as broker:
        publish_all(broker.bootstrap, run_events("job-r", time.time() - 120, seconds=40))
        out = tmp / "run.html"
        proc = subprocess.run([sys.executable, "-m", "transom.cli", "report", "job-r", "--bootstrap",
                               broker.bootstrap, "-o", str(out)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == str(out.resolve())
        assert "read 120 messages of transom.metrics" in proc.stderr      # progress on stderr
        missing = subprocess.run([sys.executable, "-m", "transom.cli", "report", "no-such-job", "--bootstrap",
                                  broker.bootstrap, "-o", str(tmp / "none.html")], capture_output=True, text=True,
                                 timeout=120)
    return out, missing


def test_report_tells_the_run(report_file):
    out, _ = report_file
    page = out.read_text()
    assert "Transom run report: job job-r" in page
    # loss and throughput: one line per launch generation
    assert page.count('<path d="M') == 2 * 2
    # markers: the XID fault, the eviction, the resume, both checkpoints
    assert re.search(r"<title>xid on node1: XID 79", page)
    assert "<title>relaunching: reason=XID 79, evicted=node1, replacement=node2" in page
    assert "<title>resumed: generation=1, resume_step=4, step=4, steps_lost=2</title>" in page
    assert page.count("<title>checkpoint step 4 ready</title>") == 3      # loss, throughput, stalls
    assert "checkpoint step 8 ready" in page
    # stalls as bars, restores by tier, heatmap cells with a fault on node1 only
    assert "save stall (slowest rank): 0.005" in page
    assert "<td>peer memory</td>" in page
    assert re.search(r"<title>node1 [0-9-]+s: fault</title>", page)
    assert not re.search(r"<title>node[02] [0-9-]+s: fault</title>", page)
    # the timeline table, in time order
    rows = re.findall(r"<td>\+([0-9.]+)s</td><td>(\w+)</td>", page)
    assert [float(t) for t, _ in rows] == sorted(float(t) for t, _ in rows)
    assert {kind for _, kind in rows} == {"lifecycle", "fault", "checkpoint"}
    assert "time to detect<b>0.30 s</b>" in page        # of the XID the controller acted on
    assert "time to recover<b>2.0 s (fault to first step after resume)</b>" in page


def test_report_is_self_contained(report_file):
    page = report_file[0].read_text()
    assert "<script" not in page and "<link" not in page and "@import" not in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)
    assert not re.search(r"url\(", page)


def test_tier_names_agree_with_the_sink_and_the_dashboards():
    from transom import dashboards, report
    from transom.streams import sink

    assert report.TIER_NAMES == sink.RESTORE_TIERS
    (mapping,) = dashboards._TIER_MAPPING
    assert {int(k): v["text"] for k, v in mapping["options"].items()} == sink.RESTORE_TIERS


def test_unknown_job_is_an_error(report_file):
    _, missing = report_file
    assert missing.returncode == 1
    assert "hold no lifecycle, training or checkpoint event of job 'no-such-job'" in missing.stderr


@pytest.mark.integration
def test_report_renders_in_headless_chromium_without_console_errors(report_file, tmp_path):
    out, _ = report_file
    # the check itself: a page with a console error and a script error is caught
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><p>x</p><script>console.error('boom'); notDefined();</script></body></html>")
    caught = chromium_console(bad, tmp_path / "bad.png", size="400,300", min_bytes=500)
    assert any("boom" in line for line in caught) and any("notDefined" in line for line in caught)
    assert chromium_console(out, tmp_path / "report.png") == []
    shutil.copy(tmp_path / "report.png", tmp_path.parent / "transom-report.png")   # to look at


@pytest.mark.parametrize("detail", [
    {"spec": {"command": ["python", "train.py"], "world_size": 2}, "spares": 1},    # transom run --spares 1
    {"spec": {"command": ["python", "train.py"], "world_size": 2}, "spares": 0},    # transom run
    {"command": ["python", "train.py"], "nodes": ["node0", "node1", "node2"],       # transom controller --job-id
     "spec": {"command": ["python", "train.py"], "world_size": 2}},
], ids=["run-spares", "run", "controller-job-id"])
def test_report_works_for_every_way_a_job_is_submitted(broker, detail):
    """`transom run --spares N` writes the spare *count* into submit_requested; the report read it as
    a node list and crashed (TypeError: 'int' object is not iterable)."""
    from transom import contracts as c
    from transom.report import collect, render

    job = f"job-way-{len(detail)}-{detail.get('spares', 'c')}-{time.time_ns()}"
    t0 = time.time() - 30
    name, seq = ("submit_requested", -1) if "spares" in detail else ("submitted", 0)
    events = [(c.LIFECYCLE, job, c.LifecycleEvent(job=job, seq=seq, ts=t0, name=name, state="pending",
                                                  detail=detail))]
    events += [ev for ev in run_events(job, t0 + 1, metrics=False) if ev[0] == c.LIFECYCLE and ev[2].seq > seq]
    publish_all(broker.bootstrap, events)
    data = collect(broker.bootstrap, job)
    assert {"node0", "node1", "node2"} <= set(data.nodes)
    assert job in render(data)
