"""bench/goodput.py's cheap parts: its --help, the seeded fault schedule, the straggler hook and injection.

The bench itself (two runs of several minutes) is not run by the suite.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from transom.agents.agent import Agent
from transom.agents.intake import send_inject

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "goodput.py"


def _bench():
    spec = importlib.util.spec_from_file_location("goodput_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_help_lists_the_knobs():
    out = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    for flag in ("--seed", "--quick", "--fault-every", "--kinds", "--watchdog", "--ckpt-every", "--width",
                 "--straggler-factor", "--runs"):
        assert flag in out.stdout


def test_schedule_is_a_function_of_the_seed_and_mixes_every_kind():
    g = _bench()
    a = g.make_schedule(7, 60.0, 8, 4)
    assert a == g.make_schedule(7, 60.0, 8, 4)
    assert a != g.make_schedule(8, 60.0, 8, 4)
    assert sorted(f.kind for f in a[:4]) == sorted(g.KINDS) == sorted(f.kind for f in a[4:])
    for i, f in enumerate(a):
        assert f.index == i and 0 <= f.rank < 4
        assert 60.0 * (i + 1) - 12.0 <= f.offset_s <= 60.0 * (i + 1) + 12.0
    assert [f.kind for f in g.make_schedule(3, 10.0, 3, 2, kinds=("hang",))] == ["hang"] * 3
    with pytest.raises(ValueError, match="meltdown"):
        g.make_schedule(1, 60.0, 4, 4, kinds=("crash", "meltdown"))


def test_bad_flags_name_what_is_wrong():
    g = _bench()
    with pytest.raises(SystemExit):
        g.parse_args(["--runs", "slurm"])
    args = g.parse_args(["--quick", "--seed", "5"])
    assert (args.steps, args.width, args.seed) == (g.QUICK["steps"], g.QUICK["width"], 5)
    assert args.schedule == g.make_schedule(5, g.QUICK["fault_every"], g.QUICK["faults"], 4)


def test_straggler_hook_stretches_steps_only_for_the_slow_node(tmp_path, monkeypatch):
    from transom.examples.train_lm import slowdown
    monkeypatch.setenv("TRANSOM_NODE", "node2")
    assert slowdown(str(tmp_path), 0.02) == 0.0                 # no file: full speed
    (tmp_path / "node2").write_text("0.5\n")
    assert slowdown(str(tmp_path), 0.02) == pytest.approx(0.02)  # half speed: the step takes twice as long
    (tmp_path / "node2").write_text("fast\n")
    assert slowdown(str(tmp_path), 0.02) == 0.0
    monkeypatch.delenv("TRANSOM_NODE")
    monkeypatch.setenv("RANK", "3")
    (tmp_path / "slot3").write_text("0.8")
    assert slowdown(str(tmp_path), 0.04) == pytest.approx(0.01)
    (tmp_path / "slot3").write_text("0.8 0.015\n")             # the bench's fixed extra seconds win
    assert slowdown(str(tmp_path), 0.04) == pytest.approx(0.015)


def test_agent_injects_a_straggler_on_its_simulated_gpu(broker):
    with Agent(f"gp-{uuid.uuid4().hex[:6]}", broker.bootstrap, gpu_source="simulated", gpus=1, interval=0.5) as agent:
        reply = send_inject(agent.intake_addr, "straggler", gpu=0, timeout=10)
        assert reply["ok"] and reply["fault"] == "straggler", reply
        assert [f.kind for f in agent.simulated.played] == ["straggler"]
        bad = send_inject(agent.intake_addr, "straggler", gpu=3, timeout=10)
        assert not bad["ok"] and "GPU 3" in bad["error"]
