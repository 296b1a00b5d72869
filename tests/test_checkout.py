"""The suite and the package work from any checkout: no path of the build machine, packaged data."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_absolute_path_of_a_build_machine_in_the_tree():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    bad = []
    for name in files:
        path = ROOT / name
        if path.suffix in (".png", ".json") or not path.is_file() or name == "tests/test_checkout.py":
            continue
        text = path.read_text(errors="replace")
        bad += [f"{name}: {marker}" for marker in ("/work/", "/home/") if marker in text]
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
