"""The example training script, run for real: 2 DDP ranks (gloo) as subprocesses on 127.0.0.1.

- it trains (loss goes down), checkpoints, announces the checkpoints, and exits 0;
- killed mid-run and relaunched, both ranks resume from the newest complete checkpoint;
- a resumed run continues bit for bit as the uninterrupted run (model, optimizer, data position);
- a rank relaunched on a spare node restores from its old node's replica in the neighbour's memory,
  and its checkpoint engine reports ``ckpt_stall_s``, ``restore_s`` and ``restore_tier`` to the agent as events;
- a node whose shared memory cannot hold the checkpoints stops the job before its first step.

The ranks checkpoint through real TCE daemons (``transom ckpt-server``), one per simulated node.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Callable

import pytest
import torch

from transom import contracts
from transom.broker import free_port
from transom.checkpoint import complete_steps, list_steps, step_dir
from transom.checkpoint import shardfmt
from transom.checkpoint.layout import read_manifest

from test_checkpoint import Cluster, copies_of, flip_bit
from util import topic_values, wait_until

pytestmark = pytest.mark.integration

_PROGRESS = re.compile(r"^step (\d+)/(\d+) loss ([0-9.]+) tok/s (\d+) gen (\d+)$", re.M)


class Ranks:
    """The ranks of one launch of train_lm, with their output in files under ``logs``."""

    def __init__(self, logs: Path, ckpt: Path, world: int, args: list[str], *, job: str,
                 generation: int = 0, bootstrap: str | None = None, env: dict | None = None,
                 nodes: list[str] | None = None) -> None:
        port = str(free_port())
        self.procs: list[subprocess.Popen] = []
        self.outputs: list[Path] = []
        for rank in range(world):
            penv = {k: v for k, v in os.environ.items()
                    if k not in ("TRANSOM_BOOTSTRAP", "TRANSOM_RESUME_STEP", "TRANSOM_AGENT_ADDR")}
            penv.update(PYTHONUNBUFFERED="1", TRANSOM_CKPT_DIR=str(ckpt), TRANSOM_JOB=job,
                       TRANSOM_GENERATION=str(generation), TRANSOM_NODE=nodes[rank] if nodes else f"node{rank}",
                       TRANSOM_CKPT_RUNTIME=_RUNTIME.get("dir", ""))
            if world > 1:
                penv.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            else:
                for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                    penv.pop(k, None)
            if bootstrap:
                penv["TRANSOM_BOOTSTRAP"] = bootstrap
            penv.update(env or {})
            out = logs / f"gen{generation}-rank{rank}-{uuid.uuid4().hex[:6]}.log"
            with open(out, "wb") as f:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "transom.examples.train_lm", *args],
                    stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=penv))
            self.outputs.append(out)

    def wait(self, timeout: float) -> list[int]:
        try:
            return [p.wait(timeout) for p in self.procs]
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def output(self, rank: int = 0) -> str:
        return self.outputs[rank].read_text(errors="replace")

    def explain(self, codes: list[int] | None = None) -> str:
        """Exit codes and the end of every rank's output, for assertion messages."""
        tails = "".join(f"\n--- rank {r} ---\n{self.output(r)[-2500:]}" for r in range(len(self.outputs)))
        return f"exit codes {codes}{tails}"

    def port_was_taken(self) -> bool:
        return any("EADDRINUSE" in self.output(r) for r in range(len(self.outputs)))


def run_to_end(launches: list[Ranks], make: Callable[[], Ranks], timeout: float = 120) -> tuple[Ranks, list[int]]:
    """Launch and wait for every rank. free_port() only finds a port that is free *now*: on a busy
    machine another process can bind it before rank 0 does, so that one case is relaunched once
    (with a new port) before it counts as a failure."""
    for attempt in range(2):
        run = make()
        launches.append(run)
        codes = run.wait(timeout)
        if attempt == 0 and any(codes) and run.port_was_taken():
            continue
        return run, codes
    raise AssertionError("unreachable")


_RUNTIME: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def daemons(tmp_path_factory):
    """One TCE daemon per simulated node (node0..node3), for every launch of this module."""
    c = Cluster(tmp_path_factory.mktemp("daemons"), ["node0", "node1", "node2", "node3"], transport="tcp")
    _RUNTIME["dir"] = str(c.runtime)
    yield c
    _RUNTIME.clear()
    c.close()


@pytest.fixture()
def launches():
    started: list[Ranks] = []
    yield started
    for r in started:
        r.kill()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, broker):
    """One finished 2-rank run of 40 steps, checkpointing every 10, announcing to the broker."""
    tmp = tmp_path_factory.mktemp("trained")
    job = f"lm-{uuid.uuid4().hex[:8]}"
    started: list[Ranks] = []
    try:
        run, codes = run_to_end(started, lambda: Ranks(
            tmp, tmp / "ckpt", 2, ["--steps", "40", "--ckpt-every", "10"], job=job,
            bootstrap=broker.bootstrap))
    finally:
        for r in started:
            r.kill()
    return {"job": job, "codes": codes, "out": run.output(0), "ckpt": tmp / "ckpt",
            "explain": run.explain(codes)}


def copy_steps(src: Path, dst: Path, *steps: int) -> Path:
    for s in steps:
        shutil.copytree(step_dir(src, s), step_dir(dst, s))
    return dst


def test_two_ranks_train_checkpoint_and_announce(trained, broker):
    out, ckpt, job = trained["out"], trained["ckpt"], trained["job"]
    assert trained["codes"] == [0, 0], trained["explain"]
    losses = [float(m.group(3)) for m in _PROGRESS.finditer(out)]
    assert len(losses) == 4, out[-3000:]
    assert losses[-1] < losses[0] - 1.0, f"loss did not go down: {losses}"
    assert "done: 40 steps, last checkpoint step 40" in out
    assert complete_steps(ckpt) == [20, 30, 40], "keep 3 complete checkpoints"

    def announced():
        events = [e for e in topic_values(broker.bootstrap, contracts.CHECKPOINTS) if e.job == job]
        return events if len(events) >= 4 else None

    events = wait_until(announced, 30, f"4 checkpoint-ready events of {job}")
    assert sorted(e.step for e in events) == [10, 20, 30, 40]
    assert all(e.world_size == 2 and len(e.shards) == 2 for e in events)


def test_ranks_agree_on_an_older_step_when_one_ranks_newest_shard_is_corrupt(trained, tmp_path, launches):
    assert trained["codes"] == [0, 0], trained["explain"]
    ckpt = copy_steps(trained["ckpt"], tmp_path / "ckpt", 30, 40)
    shard = step_dir(ckpt, 40) / "rank-00001.safetensors"
    flip_bit(shard)
    size = read_manifest(step_dir(ckpt, 40)).shards[1].size
    for (tier, _node), where in copies_of(ckpt, 40, rank=1).items():   # every other copy too
        if tier != "shared":
            flip_bit(Path(where), at=size // 2)
    run, codes = run_to_end(launches, lambda: Ranks(
        tmp_path, ckpt, 2, ["--steps", "50", "--ckpt-every", "10"], job=trained["job"], generation=1))
    assert codes == [0, 0], run.explain(codes)
    assert "resumed from step 30 gen 1" in run.output(0), run.explain(codes)
    assert f"{shard}: digest mismatch" in run.output(1), run.explain(codes)
    assert complete_steps(ckpt) == [30, 40, 50]
    assert read_manifest(step_dir(ckpt, 40)).generation == 1, "the corrupt step 40 was replaced"


def test_resumed_run_continues_exactly_like_the_uninterrupted_run(trained, tmp_path, launches):
    """Two ranks resumed from step 20 reach step 40 with the very state of the run that was not
    interrupted: model, optimizer and data position, bit for bit."""
    assert trained["codes"] == [0, 0], trained["explain"]
    ckpt = copy_steps(trained["ckpt"], tmp_path / "ckpt", 20, 30)
    run, codes = run_to_end(launches, lambda: Ranks(
        tmp_path, ckpt, 2, ["--steps", "40", "--ckpt-every", "10"], job=trained["job"], generation=1,
        env={"TRANSOM_RESUME_STEP": "20"}))      # the controller's choice wins over the newest, 30
    assert codes == [0, 0], run.explain(codes)
    assert "resumed from step 20 gen 1" in run.output(0), run.explain(codes)
    for rank in range(2):
        name = f"rank-{rank:05d}.safetensors"
        whole = shardfmt.decode(bytearray((step_dir(trained["ckpt"], 40) / name).read_bytes()))
        resumed = shardfmt.decode(bytearray((step_dir(ckpt, 40) / name).read_bytes()))
        # data-parallel replicas: rank 0's shard has the model and optimizer every rank loads
        parts = ("model", "optimizer", "data") if rank == 0 else ("data", "rng")
        assert rank == 0 or "model" not in resumed and "optimizer" not in resumed
        for part in parts:
            assert _flat(whole[part]) == _flat(resumed[part]), f"rank {rank}: {part} differs after resume"


def test_resume_step_that_does_not_exist_exits_3(tmp_path, launches):
    run = Ranks(tmp_path, tmp_path / "ckpt", 1, ["--steps", "5"], job="lm-none",
                env={"TRANSOM_RESUME_STEP": "10"})
    launches.append(run)
    codes = run.wait(60)
    assert codes == [3], run.explain(codes)
    assert "cannot resume from step 10 (TRANSOM_RESUME_STEP): no checkpoint of step 10" in run.output()


def test_killed_rank_then_relaunch_resumes_from_newest_checkpoint(tmp_path, launches):
    ckpt = tmp_path / "ckpt"
    first = Ranks(tmp_path, ckpt, 2, ["--steps", "2000", "--ckpt-every", "10"], job="lm-kill")
    launches.append(first)
    wait_until(lambda: [s for s in complete_steps(ckpt) if s >= 20]
               or any(p.poll() is not None for p in first.procs), 90, "checkpoint step 20")
    assert all(p.poll() is None for p in first.procs), first.explain([p.poll() for p in first.procs])
    first.procs[1].send_signal(signal.SIGKILL)
    rc0 = first.procs[0].wait(60)          # the surviving rank fails on its own: its peer is gone
    first.procs[1].wait()
    assert rc0 != 0, first.explain([rc0, -9])
    newest = complete_steps(ckpt)[-1]
    assert newest >= 20

    agent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)     # stands in for the node agent's intake
    agent.bind(("127.0.0.1", 0))
    agent.settimeout(0.2)
    addr = f"127.0.0.1:{agent.getsockname()[1]}"
    try:
        second, codes = run_to_end(launches, lambda: Ranks(      # node1 is gone: rank 1 runs on node3
            tmp_path, ckpt, 2, ["--steps", str(newest + 20), "--ckpt-every", "10"], job="lm-kill",
            generation=1, nodes=["node0", "node3"], env={"TRANSOM_AGENT_ADDR": addr}))
        reports = []
        while True:
            try:
                reports.append(json.loads(agent.recv(65536)))
            except (TimeoutError, socket.timeout):
                break
    finally:
        agent.close()
    out = second.output(0)
    assert codes == [0, 0], second.explain(codes)
    assert f"resumed from step {newest} gen 1" in out, second.explain(codes)
    assert f"rank 0: restored step {newest} from local-memory on node0" in out, second.explain(codes)
    assert f"rank 1: restored step {newest} from peer-memory on node2" in second.output(1), second.explain(codes)
    # its model and optimizer come from rank 0's shard (saved once for all data-parallel replicas)
    assert "(model and optimizer: rank 0's shard from peer-memory on node" in second.output(1), second.explain(codes)
    # the checkpoint engine reports its own restores and save stalls, as events (not the script)
    restore = {r["rank"]: r for r in reports if r.get("event") == "restore" and r["restore_shard_rank"] == r["rank"]}
    assert restore[0]["restore_tier"] == 0 and restore[1]["restore_tier"] == 1, reports[:4]
    assert all(r["restore_s"] > 0 and r["restore_step"] == newest for r in restore.values())
    assert not [r for r in reports if "restore_tier" in r and not r.get("event")]
    stalls = [r for r in reports if r.get("event") == "checkpoint_save"]
    assert sorted({r["step"] for r in stalls}) == [newest + 10, newest + 20]
    assert len(stalls) == 4 and not [r for r in reports if "ckpt_stall_s" in r and not r.get("event")]
    assert all(r["ckpt_stall_s"] > 0 for r in stalls)
    steps = [int(m.group(1)) for m in _PROGRESS.finditer(out)]
    assert steps and steps[0] == newest + 10 and steps[-1] == newest + 20, steps
    assert complete_steps(ckpt)[-1] == newest + 20


def test_too_small_shared_memory_stops_the_job_before_training(tmp_path, launches):
    run = Ranks(tmp_path, tmp_path / "ckpt", 1, ["--steps", "5"], job="lm-small",
                env={"TRANSOM_CKPT_SHM_BYTES": "100000", "TRANSOM_NODE": "node-small"})
    launches.append(run)
    codes = run.wait(60)
    out = run.output()
    assert codes == [4], run.explain(codes)
    assert "cannot start: checkpoints need" in out and "budget" in out and "--mem-keep" in out, out[-2000:]
    assert "step 1/" not in out and complete_steps(tmp_path / "ckpt") == []


def _flat(obj):
    """A comparable form of a state: tensors as (dtype, shape, bytes)."""
    if isinstance(obj, torch.Tensor):
        return (str(obj.dtype), tuple(obj.shape), obj.contiguous().view(torch.uint8).numpy().tobytes()
                if obj.dim() else obj.reshape(1).view(torch.uint8).numpy().tobytes())
    if isinstance(obj, dict):
        return {k: _flat(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_flat(v) for v in obj]
    return obj


def _saved_steps(steps_file: Path) -> list[int]:
    return [int(ln.split()[0]) for ln in steps_file.read_text().splitlines() if ln.split()[3:] == ["s"]]


def test_auto_cadence_every_rank_saves_the_same_steps(tmp_path, launches):
    """--ckpt-every auto (the default): both ranks save the steps their agreed cadence names, each
    checkpoint complete; with a fault every 0.01 s the interval is as short as saves allow (each save
    as soon as the last is done): 10 steps in, 10 more while its cost is measured, then every few."""
    ckpt, steps_file = tmp_path / "ckpt", tmp_path / "steps.txt"
    run, codes = run_to_end(launches, lambda: Ranks(
        tmp_path, ckpt, 2, ["--steps", "50", "--mtbf", "0.01", "--keep", "1000", "--steps-file", str(steps_file)],
        job=f"cad-{uuid.uuid4().hex[:6]}"))
    assert codes == [0, 0], run.explain(codes)
    saved = _saved_steps(steps_file)
    steps = list_steps(ckpt)
    assert [s.step for s in steps if s.complete] == saved, "every step rank 0 saved is complete: rank 1 saved it too"
    assert all(s.complete for s in steps), [s.step for s in steps if not s.complete]
    assert saved[:2] == [10, 20] and saved[-1] == 50 and len(saved) >= 6, saved
    assert "checkpoint interval" in run.output(0), "the cadence logs the interval it chose and why"


def test_bad_command_line_values_name_the_flag(capsys):
    from transom.examples.train_lm import parse_args

    assert parse_args([]).ckpt_every is None and parse_args(["--ckpt-every", "0"]).ckpt_every == 0
    for argv, says in ((["--ckpt-every", "often"], "argument --ckpt-every: 'often': expected a number of steps"),
                       (["--eval-pause", "200"], "--eval-pause '200': expected STEP:SECONDS"),
                       (["--mtbf", "-5"], "--mtbf -5.0: expected seconds > 0")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2 and says in capsys.readouterr().err
