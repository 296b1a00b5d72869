"""The suite and the package work from any checkout: no path of the build machine, packaged data."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_absolute_path_of_a_build_machine_in_the_tree():
    """No file names the folder this checkout lives in (a user's lives elsewhere), nor a home directory."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    bad = []
    for name in files:
        path = ROOT / name
        if path.suffix in (".png", ".json") or not path.is_file() or name == "tests/test_checkout.py":
            continue
        text = path.read_text(errors="replace")
        bad += [f"{name}: {marker}" for marker in (f"{ROOT.parent}/", "/" + "home/") if marker in text]
    assert not bad, bad


def test_the_fault_mix_ships_with_the_package(monkeypatch):
    from transom.streams import corpus

    monkeypatch.delenv("TRANSOM_FAULT_TRACE", raising=False)
    shares, durations, summary = corpus.trace_mix()
    assert abs(sum(shares.values()) - 1.0) < 1e-9 and summary["trace_faults_mapped"] > 0
    assert set(durations) == set(corpus.FaultClass)


def test_the_makefile_installs_every_command_a_test_looks_up():
    import re

    tools = re.search(r"^TOOLS := (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()
    installed = {t.split(":")[0] for t in tools}
    looked_up = set()
    for path in (ROOT / "tests").rglob("*.py"):
        looked_up |= set(re.findall(r"""shutil\.which\(["']([\w.-]+)["']\)""", path.read_text()))
    looked_up -= {"chromium-browser"}            # another distribution's name for chromium
    assert looked_up <= installed, f"tests look up {sorted(looked_up - installed)}: add them to TOOLS in the Makefile"


def test_two_stacks_of_one_user_never_join_one_ring(tmp_path):
    """Two stacks on one host, told apart by their brokers: each daemon registers in its own stack's
    runtime directory, so neither takes the other for its ring neighbour (issue 15: both used
    /dev/shm/transom-ckpt-UID)."""
    import os
    import shutil
    import signal
    import sys
    import time

    from transom.checkpoint import segments

    stacks = {"127.0.0.1:19092": "n0", "127.0.0.1:29092": "n1"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSOM_CKPT_")}
    procs = []
    try:
        for bootstrap, node in stacks.items():
            procs.append(subprocess.Popen([sys.executable, "-m", "transom.cli", "ckpt-server", "--node", node],
                                          env={**env, "TRANSOM_BOOTSTRAP": bootstrap}, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{node}.log", "wb")))
        runtimes = {b: segments.default_runtime(b) for b in stacks}
        assert len(set(runtimes.values())) == 2 and segments.default_local_dir("a") != segments.default_local_dir("b")
        deadline = time.monotonic() + 60
        while not all(segments.registered(runtimes[b]).get(n) for b, n in stacks.items()):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [(tmp_path / f"{n}.log").read_text()[-2000:] for n in stacks.values()]
            time.sleep(0.2)
        for bootstrap, node in stacks.items():
            assert set(segments.registered(runtimes[bootstrap])) == {node}
            assert segments.runtime_dir(None, bootstrap) == runtimes[bootstrap]      # where its ranks look
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for bootstrap in stacks:
            shutil.rmtree(segments.default_runtime(bootstrap), ignore_errors=True)
            shutil.rmtree(segments.default_local_dir(bootstrap), ignore_errors=True)
