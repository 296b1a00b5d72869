"""Issue 15's acceptance, as a user would do it: their own 40-line DDP script in a folder of their
own, `transom up` in the background, `transom run ... -- python train.py` (a relative path, python
from PATH), an XID 79 injected on a node's simulated GPU, the job recovers on the spare, `transom
report` renders in headless Chromium with the restore and every save stall, `transom cancel`,
`transom nodes uncordon`, and SIGINT to `transom up` stops everything it started.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from transom import contracts as c
from transom.report import _stall_series, collect

from util import topic_values, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

TRAIN = '''\
import time
import torch
import torch.distributed as dist
from transom.agents.intake import report
from transom.checkpoint import CheckpointEngine

STEPS = 400
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
engine = CheckpointEngine.from_env()
step = 0
got = engine.load()
if got is not None:
    step, state = got
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    print(f"rank {rank}: resumed at step {step}", flush=True)
while step < STEPS:
    loss = model(torch.randn(16, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if step % 5 == 0:
        engine.save(step, {"model": model.module.state_dict(), "opt": opt.state_dict()})
    report(step=step, loss=loss.item())
    time.sleep(0.1)
engine.close()
dist.destroy_process_group()
'''


def _transom(env, cwd, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transom.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_a_users_own_script_from_up_to_ctrl_c(tmp_path):
    from test_report import chromium_console

    home = tmp_path / "project"                 # the user's folder, outside the checkout
    home.mkdir()
    (home / "train.py").write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSOM_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"     # `python` is the venv's
    env["PYTHONUNBUFFERED"] = "1"
    out = open(tmp_path / "up.out", "w+")
    up = subprocess.Popen([sys.executable, "-m", "transom.cli", "up", "--nodes", "3", "--spares", "1",
                           "--run-dir", str(tmp_path / "stack")], cwd=home, env=env, stdout=out,
                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    started: list[psutil.Process] = []
    forked: list[tuple[str, str]] = []
    try:
        text = wait_until(lambda: up.poll() is not None or ("ready:" in (t := Path(out.name).read_text()) and t),
                          120, "transom up to be ready")
        assert up.poll() is None, Path(out.name).read_text()[-3000:]
        started = psutil.Process(up.pid).children(recursive=True)
        bootstrap = re.search(r"^export TRANSOM_BOOTSTRAP=(\S+)$", text, re.M).group(1)
        intake = dict(re.findall(r"^(node\d)\s+(\S+:\d+)\s+ok$", text, re.M))
        assert len(intake) == 4, text
        env["TRANSOM_BOOTSTRAP"] = bootstrap

        run = _transom(env, home, "run", "--nodes", "3", "--spares", "1", "--job-id", "mine", "--",
                       "python", "train.py")
        assert run.returncode == 0 and run.stdout.strip() == "mine", run.stderr
        names = lambda: [e.name for e in topic_values(bootstrap, c.LIFECYCLE) if e.job == "mine"]   # noqa: E731
        wait_until(lambda: "first_step" in names() and "checkpoint" in names(), 180, "a first step and checkpoint")
        launched = next(e for e in topic_values(bootstrap, c.LIFECYCLE) if e.job == "mine" and e.name == "launched")
        victim = launched.snapshot["nodes"][1]
        inject = _transom(env, home, "inject", "xid79", "--agent", intake[victim])
        assert inject.returncode == 0, inject.stderr
        wait_until(lambda: "resumed" in names(), 180, "the job resumed on the spare")
        timeline = _transom(env, home, "jobs", "show", "mine").stdout
        assert f'"evicted":"{victim}"' in timeline, timeline

        gen1 = tmp_path / "stack" / "jobs" / "mine" / "gen-1"
        logs = "".join(p.read_text() for p in gen1.glob("rank-*.log"))
        assert "resumed at step" in logs, logs[-3000:]

        report = _transom(env, home, "report", "mine", "-o", str(tmp_path / "mine.html"))
        assert report.returncode == 0, report.stderr
        html = (tmp_path / "mine.html").read_text()
        assert "no restore reported" not in html and "peer memory" in html, html[-3000:]
        # every save the engine made has its stall bar; per generation: after the relaunch a step may be
        # saved again, a stall bar each. The job still runs: a save's event comes with its node agent's
        # next batch, its checkpoint-ready at once, so the newest one or two (a loaded machine) may trail
        def saved(data) -> set:
            return {(t["generation"], int(t["step"])) for t in data.train if t.get("event") == "checkpoint_save"}

        def caught_up():
            data = collect(bootstrap, "mine")
            return data if set(sorted(ck.step for ck in data.checkpoints)[:-1]) <= {s for _, s in saved(data)} \
                else None
        data = wait_until(caught_up, 60, "a checkpoint_save event for every checkpoint but the newest")
        saves = saved(data)
        (_, _, bars), = _stall_series(data, 0.0)
        assert len(bars) == len(saves), (len(bars), sorted(saves))
        errors = chromium_console(tmp_path / "mine.html", tmp_path / "mine.png")
        assert not [e for e in errors if "ERROR" in e.upper()], errors

        cancel = _transom(env, home, "cancel", "mine")
        assert cancel.returncode == 0 and "cancelled" in cancel.stdout, cancel.stdout + cancel.stderr
        # the node view is written when it changes, at most every 5 s (docs/controller.md): the cordon of
        # the eviction shows within that, however fast the steps above ran
        wait_until(lambda: any(ln.startswith(victim) and "xid" in ln.lower()
                               for ln in _transom(env, home, "nodes").stdout.splitlines()),
                   30, f"{victim}'s xid cordon in the node view")
        back = _transom(env, home, "nodes", "uncordon", victim, "--reason", "GPU replaced")
        line = next(ln for ln in back.stdout.splitlines() if ln.startswith(victim))
        assert back.returncode == 0 and "-" in line.split()[2:3] + line.split()[-2:], back.stdout

        controller_log = (tmp_path / "stack" / "logs" / "controller.log").read_text()
        forked = re.findall(r"(\d+) of (\d+) ranks forked from the zygote", controller_log)
        assert forked, controller_log[-3000:]
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
        try:
            rc = up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
            rc = None
        left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for p in left:
            p.kill()
    assert rc == 0, Path(out.name).read_text()[-3000:]
    assert "transom up: stopped" in Path(out.name).read_text()
    assert not left, [p.cmdline() for p in left]
    assert forked[-1][0] == forked[-1][1], f"the relaunch started ranks cold ({forked[-1][0]} of {forked[-1][1]} forked)"
