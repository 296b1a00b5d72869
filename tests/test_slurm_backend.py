"""The Slurm backend against the fake Slurm, where srun's task order differs from the order asked.

The fake srun numbers tasks as the real one does (by the cluster's node table, not by
``--nodelist``), so a generation on ``node4,node1,node2,node3`` runs rank 0 on node1. Each rank
records its environment; rank 0 must run on the node ``MASTER_ADDR`` names.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from transom.controller.fakes.slurm import install
from transom.controller.rankwrap import expand_hostlist, slurm_master
from transom.controller.slurm import SlurmBackend

from util import wait_until

NODES = [f"node{i}" for i in range(5)]
AGENTS = {n: f"127.0.0.{i + 1}:{7000 + i}" for i, n in enumerate(NODES)}   # one address per node
DUMP_ENV = [sys.executable, "-c", "import json, os; json.dump({k: os.environ.get(k) for k in ('RANK', 'MASTER_ADDR', "
            "'SLURMD_NODENAME', 'TRANSOM_NODE', 'TRANSOM_AGENT_ADDR')}, "
            "open(os.environ['OUT'] + '/env-' + os.environ['RANK'] + '.json', 'w'))"]


@pytest.fixture()
def slurm(tmp_path, monkeypatch):
    for k, v in install(tmp_path / "bin", tmp_path / "slurm.json", NODES).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("MASTER_ADDR", "wrong-if-passed-on")
    backend = SlurmBackend(tmp_path / "runs", agents=AGENTS)
    yield backend
    backend.close()


def test_hostlist_and_task_zero_follow_slurms_node_list():
    assert expand_hostlist("n[1-3,7],gpu[008-010],login") == ["n1", "n2", "n3", "n7", "gpu008", "gpu009", "gpu010",
                                                               "login"]
    assert slurm_master({"SLURM_STEP_NODELIST": "node[1-4]", "TRANSOM_AGENTS": "node1=10.0.0.5:7000"}) == \
        ("node1", "10.0.0.5")
    assert slurm_master({"SLURM_JOB_NODELIST": "gpu[002,001]"}) == ("gpu002", "gpu002")   # no agent: the name


def test_rank_zero_runs_on_the_master_addr_node_when_srun_reorders_the_nodes(slurm, tmp_path):
    asked = ("node4", "node1", "node2", "node3")         # a spare replaced node0: srun sorts node1 first
    slurm.launch("job", 1, asked, tuple(DUMP_ENV), None)
    wait_until(lambda: (st := slurm.status("job", 1)) and all(not r.running for r in st), 60, "the step to end")
    assert [(r.exit_code, r.node) for r in slurm.status("job", 1)] == \
        [(0, "node1"), (0, "node2"), (0, "node3"), (0, "node4")]               # where each rank ran
    envs = {r: json.loads((tmp_path / f"env-{r}.json").read_text()) for r in range(4)}
    on = {r: e["SLURMD_NODENAME"] for r, e in envs.items()}
    assert on == {0: "node1", 1: "node2", 2: "node3", 3: "node4"}        # srun's order, not the one asked
    master = {e["MASTER_ADDR"] for e in envs.values()}
    assert master == {AGENTS[on[0]].split(":")[0]}                         # every rank meets rank 0's node
    assert all(e["TRANSOM_NODE"] == e["SLURMD_NODENAME"]                   # its own node's agent, on loopback
               and e["TRANSOM_AGENT_ADDR"] == "127.0.0.1:" + AGENTS[e["TRANSOM_NODE"]].split(":")[1]
               for e in envs.values())
    placed = slurm.placement("job", 1)
    assert {r: p["node"] for r, p in placed.items()} == on
    assert {p["master_node"] for p in placed.values()} == {"node1"}


WAIT = [sys.executable, "-c", "import os, time; open(os.environ['OUT'] + '/up-' + (os.environ['TRANSOM_NODE'] + "
        "'-spare' if os.environ.get('TRANSOM_SPARE') else os.environ['RANK']), 'w').close(); time.sleep(300)"]


def test_warm_spares_wait_as_batch_jobs_and_take_a_killed_ranks_place(slurm, tmp_path):
    assert slurm.warm_spares
    slurm.launch("job", 0, ("node0", "node1"), tuple(WAIT), None)
    spare = slurm.start_spare("job", 0, "node2", tuple(WAIT))
    wait_until(lambda: all((tmp_path / f).exists() for f in ("up-0", "up-1", "up-node2-spare")), 60,
               "both ranks and the spare up")
    assert [(s.rank, s.running) for s in slurm.status("job", 0)] == [(0, True), (1, True)]   # a spare is no rank
    master = slurm.heal("job", 0, 1, "node2", ("node0", "node2"))
    assert master.startswith(AGENTS["node0"].split(":")[0] + ":")           # rank 0's node, as srun placed it
    assert slurm.heal("job", 0, 1, "node2", ("node0", "node2")) == master   # repeated: the same, nothing more
    gen = tmp_path / "runs" / "job" / "gen-0"
    wait_until(lambda: (gen / "rank-1.exit").exists(), 30, "the old rank 1 killed on node1")
    assert (gen / "rank-1.exit").read_text().split()[0] == str(-9)
    assert [(s.rank, s.running, s.node) for s in slurm.status("job", 0)] == [(0, True, "node0"), (1, True, "node2")]
    with pytest.raises(RuntimeError, match="no waiting spare"):
        slurm.heal("job", 0, 0, "node2", ("node2", "node2"))
    slurm.stop("job", 0, timeout=20)                   # the generation's allocation and the spare's
    wait_until(lambda: (gen / "rank-0.exit").exists() and (Path(spare["dir"]) / "rank-0.exit").exists(), 30,
               "every rank ended")
    assert [s.running for s in slurm.status("job", 0)] == [False, False]
