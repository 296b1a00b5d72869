"""Transom's Slurm backend against a real Slurm cluster on the hosts test bed (transom/slurmbed.py).

Six hosts: ``ctl`` runs slurmctld, node0..node4 a slurmd, a node agent with a simulated GPU each.
The broker listens on the bed's root address; the TEE and the controller run here, in the root
namespace, as on a login node. A 4-rank job with one spare runs as Slurm batch jobs. The ranks are
light (no torch): each does a real rendezvous, rank 0 listening on ``MASTER_ADDR:MASTER_PORT`` (a
bind that fails unless ``MASTER_ADDR`` is its own host) and the others connecting to it, then
reports steps to its node's agent. An XID 79 injected on node0's simulated GPU goes agent -> TEE ->
controller, which drains node0 in Slurm and relaunches on the spare: the new node list
``node4,node1,node2,node3`` is one srun reorders, so rank 0 runs on node1 and ``MASTER_ADDR`` must
follow it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from transom import contracts as c
from transom.broker import EmbeddedBroker
from transom.kafka import make_producer, publish
from transom.slurmbed import SlurmBed, available

from util import topic_values, until_alive, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.integration]
NODES = [f"node{i}" for i in range(5)]
INTAKE = 7100
RANK = """
import json, os, socket, time
from transom.agents.intake import report
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
if rank == 0:                       # bind fails unless MASTER_ADDR is this host's address
    srv = socket.create_server(addr)
    srv.settimeout(60)
    for _ in range(world - 1):
        srv.accept()[0].close()
else:
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(addr, timeout=2).close()
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
gen = os.environ["TRANSOM_GENERATION"]
json.dump({"host": socket.gethostname(), "node": os.environ["TRANSOM_NODE"], "master": addr[0],
           "resume": os.environ.get("TRANSOM_RESUME_STEP")},
          open(os.path.join(os.environ["OUT"], f"gen{gen}-rank{rank}.json"), "w"))
step = int(os.environ.get("TRANSOM_RESUME_STEP") or 0)
for i in range(10**6 if step == 0 else 5):
    step += 1
    report(step=step, loss=1.0 / step, step_time_s=0.5)
    time.sleep(0.5)
"""


def stop(*procs) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            p.terminate()
    for p in procs:
        if p is not None:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_real_slurm_drains_the_faulty_node_and_the_job_resumes_on_the_spare_with_rank0_at_master_addr(bed, tmp_path):
    ok, reason = available()
    if not ok:
        pytest.skip(f"real Slurm unavailable: {reason}")
    b = bed(["ctl", *NODES], share=[tmp_path])
    out = tmp_path / "ranks"
    out.mkdir()
    procs: list = []
    with SlurmBed(b, "ctl", NODES, tmp_path / "slurm") as slurm, \
            EmbeddedBroker(host=b.root_addr, log_path=str(tmp_path / "broker.log")) as broker:
        bs = broker.bootstrap
        try:
            for node in NODES:
                procs.append(b.python(node, ["-m", "transom.cli", "agent", "--node", node, "--gpu-source", "simulated",
                                             "--gpus", "2", "--intake-port", str(INTAKE), "--bootstrap", bs],
                                      stdout=open(tmp_path / f"agent-{node}.log", "ab"), stderr=subprocess.STDOUT))
            wait_until(lambda: {m.node for m in topic_values(bs, c.METRICS, valid_only=True)} >= set(NODES), 60,
                       "a batch from every node's agent")
            env = {**slurm.env, "PYTHONUNBUFFERED": "1", "OUT": str(out)}
            tee = subprocess.Popen([sys.executable, "-m", "transom.cli", "tee", "--bootstrap", bs], env=env,
                                   stdout=open(tmp_path / "tee.log", "ab"), stderr=subprocess.STDOUT,
                                   start_new_session=True)
            procs.append(tee)
            job = "slurm-bed"
            args = [sys.executable, "-m", "transom.cli", "controller", "--bootstrap", bs, "--backend", "slurm",
                    "--run-dir", str(tmp_path / "runs"), "--precheck", "health", "--exit-when-done",
                    *(a for n in NODES for a in ("--node", f"{n}={b.addr(n)}:{INTAKE}")),
                    "--job-id", job, "--world-size", "4", "--", sys.executable, "-c", RANK]
            ctl = subprocess.Popen(args, env=env, stdout=open(tmp_path / "controller.log", "ab"),
                                   stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(ctl)
            gen0 = [out / f"gen0-rank{r}.json" for r in range(4)]
            until_alive(ctl, lambda: all(p.exists() for p in gen0), 60, "generation 0's rendezvous")
            producer = make_producer(bs)
            publish(producer, c.CHECKPOINTS, job, c.CheckpointReady(
                job=job, step=10, world_size=4, shards=tuple(c.Shard(r, f"rank-{r}", 10, "0" * 64) for r in range(4)),
                copies=tuple(c.Copy(r, NODES[r], c.Tier.SHARED, f"/ckpt/10/{r}") for r in range(4)),
                replicated=False, persisted=True, ts=time.time()))
            producer.flush(10)
            # the TEE must know node0 runs the job (its agent's training samples) before the XID means anything
            until_alive(tee, lambda: (tmp_path / "tee.log").stat().st_size > 0, 60, "the TEE")
            inject = b.python("node0", ["-m", "transom.cli", "inject", "--agent", f"127.0.0.1:{INTAKE}", "xid79",
                                        "--gpu", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            assert inject.wait(30) == 0, inject.stdout.read()
            assert ctl.wait(80) == 0, (tmp_path / "controller.log").read_text()[-3000:]
            events = [e for e in topic_values(bs, c.LIFECYCLE) if e.job == job]
        finally:
            stop(*reversed(procs))
        state, why = slurm.node_state("node0")
        assert "DRAIN" in state and "xid" in why.lower(), (state, why)         # left drained for an operator
        assert all("DRAIN" not in slurm.node_state(n)[0] for n in NODES[1:])
    assert [e.detail["generation"] for e in events if e.name == "launched"] == [0, 1]
    assert events[-1].name == "completed", [e.name for e in events]
    runs = {g: {r: json.loads((out / f"gen{g}-rank{r}.json").read_text()) for r in range(4)} for g in (0, 1)}
    for g, ranks in runs.items():
        assert all(v["host"] == v["node"] for v in ranks.values()), ranks        # TRANSOM_NODE is where it ran
        assert {v["master"] for v in ranks.values()} == {b.addr(ranks[0]["host"])}, ranks   # rank 0 at MASTER_ADDR
    assert {v["host"] for v in runs[0].values()} == {"node0", "node1", "node2", "node3"}
    assert {v["host"] for v in runs[1].values()} == {"node1", "node2", "node3", "node4"}      # on the spare
    assert runs[1][0]["host"] == "node1"                    # srun's order, not the list node4,node1,...
    assert {v["resume"] for v in runs[1].values()} == {"10"}
