"""End to end: `transom demo` runs the whole loop and heals the job after an injected XID 79 (on the test
bed's hosts where the machine can make namespaces, else on this one host).

``--scheduler slurm`` (the loop on the hosts test bed under a real Slurm cluster) is checked here
for its wiring only: the scenario itself is tests/test_slurm_bed.py's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid

import psutil
import pytest



@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_demo_recovers_from_xid79_and_completes(tmp_path):
    run_dir = tmp_path / "demo"
    cluster = f"demo-test-{uuid.uuid4().hex[:8]}"       # every process the demo starts inherits it
    proc = subprocess.run(
        [sys.executable, "-m", "transom.cli", "demo", "--steps", "160", "--ckpt-every", "20", "--fault-at", "70",
         "--run-dir", str(run_dir), "--timeout", "400"],
        capture_output=True, text=True, timeout=480,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TRANSOM_CLUSTER": cluster})
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    # the live progress and the story of the recovery
    assert "INJECT XID 79 on node1" in out
    assert re.search(r"fault\s+xid on node1", out)
    if "HEALED in the job" in out:              # one host: the local backend heals in the job (issue 17)
        assert re.search(r"healing -> recovering path=in-job .*evicted=node1", out)
        assert "recovery path  : in-job" in out and "job            : completed" in out
        recover = float(re.search(r"time to recover: ([\d.]+) s", out).group(1))
        assert recover > 0
    else:                                       # the test bed: the hosts backend relaunches
        assert re.search(r"relaunching -> recovering .*evicted=node1 replacement=node4", out)
        assert re.search(r"resumed -> running generation=1", out)
        # the summary at the end
        timeline = out[out.index("Timeline"):]
        for name in ("fault observed", "fault event (TEE)", "eviction decided", "relaunched on the spare",
                     "first step after resume"):
            assert name in timeline
        detect = float(re.search(r"time to detect : ([\d.]+) s", out).group(1))
        recover = float(re.search(r"time to recover: ([\d.]+) s", out).group(1))
        lost = int(re.search(r"steps lost     : (\d+)", out).group(1))
        assert 0 <= detect < recover
        # one interval plus the steps the ranks ran until they were stopped; two intervals when the save in
        # flight at the fault completed only after the relaunch had started (as tests/test_controller.py)
        assert lost <= 2 * 20 + 1, "steps lost must stay within two checkpoint intervals"
        assert "job            : completed" in out
        # the relaunched ranks resumed from a checkpoint, not from scratch, and finished
        # (on the bed the launchers keep rank logs under hosts/NODE/, on one host the controller under jobs/)
        (rank_log,) = [p.read_text() for p in run_dir.glob("*/**/demo/gen-1/rank-0.log")]
        assert re.search(r"resumed from step [1-9]\d* gen 1", rank_log)
    # nothing the demo started is left running
    assert _started_by(cluster) == []
    bed = re.search(r"bed tb(\d+)\)", out)
    if bed:                                     # it ran on the test bed: no namespace of it is left
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"tb{bed.group(1)}-" not in left, left
    else:
        from transom import testbed
        assert not testbed.available()[0], "the demo ran on one host although the test bed is available"
        assert "the test bed is unavailable" in out


def _started_by(cluster: str) -> list[str]:
    """Processes still running with the demo's TRANSOM_CLUSTER (in any PID namespace of this machine)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.environ().get("TRANSOM_CLUSTER") == cluster:
                found.append(" ".join(p.info["cmdline"] or [])[:200])
        except psutil.Error:
            continue
    return found


def test_demo_scheduler_slurm_wiring(monkeypatch, capsys, tmp_path):
    """The option, the controller's arguments on the bed, and a one-line refusal where no cluster can be made."""
    from transom import demo_slurm
    from transom.cli import build_parser

    args = build_parser().parse_args(["demo", "--scheduler", "slurm", "--run-dir", str(tmp_path / "run")])
    assert args.scheduler == "slurm"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--scheduler", "pbs"])
    assert "invalid choice: 'pbs'" in capsys.readouterr().err
    got = demo_slurm.controller_args("198.18.7.1:9092", tmp_path / "jobs", {"node0": "198.18.7.3:7100"},
                                     ["--exit-when-done"])
    assert got == ["controller", "--bootstrap", "198.18.7.1:9092", "--backend", "slurm", "--run-dir",
                   str(tmp_path / "jobs"), "--node", "node0=198.18.7.3:7100", "--exit-when-done"]
    demo_slurm.BedStack(tmp_path / "idle").stop()                  # nothing started: nothing to stop
    monkeypatch.setattr(demo_slurm, "available", lambda: (False, "Slurm is not installed (slurmctld missing)"))
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.strip() == "demo: --scheduler slurm cannot run here: Slurm is not installed (slurmctld missing)"
    assert not (tmp_path / "run").exists()                          # refused before anything was made
