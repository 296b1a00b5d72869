"""The recovery scenarios against the Kubernetes and Slurm fakes (they speak the platforms' real interfaces).

The Kubernetes backend talks to :class:`FakeKubeAPI` through the official ``kubernetes`` client;
the Slurm backend runs the fake ``scontrol``/``squeue``/``srun``/``scancel`` found on PATH. Both
fakes run the ranks as local processes. The job is a sleeper (the training job is exercised on the
local backend): generation 0 runs until stopped, a resumed generation ends at once. Checkpoint-ready
events are published by the test: step 10 on shared storage, step 20 only in the nodes' memory,
so evicting node1 leaves step 10 as the newest surviving checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from transom import contracts as c
from transom.controller.fakes.kube import FakeKubeAPI
from transom.controller.fakes.slurm import install
from transom.kafka import make_producer, publish
from transom.stack import LocalStack

from test_controller import NODES, fault, finish, launches, lifecycle, send
from util import until_alive

pytestmark = pytest.mark.integration
SLEEPER = [sys.executable, "-c", "import os, time; time.sleep(1 if os.environ.get('TRANSOM_RESUME_STEP') else 300)"]


@pytest.fixture(scope="module")
def agents(broker, tmp_path_factory):
    s = LocalStack(tmp_path_factory.mktemp("agents"), bootstrap=broker.bootstrap, nodes=len(NODES))
    try:
        yield s.start_agents()
    finally:
        s.stop()


class Platform:
    """One fake platform, the controller arguments that reach it, and what it says happened."""

    def __init__(self, kind: str, tmp: Path) -> None:
        self.kind, self.tmp = kind, tmp
        self.env: dict[str, str] = {}
        if kind == "kubernetes":
            self.api = FakeKubeAPI(NODES, tmp / "pods").start()
            self.args = ["--backend", "kubernetes", "--k8s-api", self.api.url]
        else:
            self.env = install(tmp / "bin", tmp / "slurm.json", NODES)
            self.args = ["--backend", "slurm"]

    def close(self) -> None:
        if self.kind == "kubernetes":
            self.api.stop()
        else:
            for srun in json.loads((self.tmp / "slurm.json").read_text())["jobs"].values():
                if srun["state"] == "RUNNING":
                    try:
                        os.kill(srun["pid"], signal.SIGTERM)
                    except ProcessLookupError:
                        pass

    def cordoned(self) -> dict[str, str]:
        if self.kind == "kubernetes":
            return {n: next(t["value"] for t in node["spec"].get("taints", []) if t["key"] == "transom.io/evicted")
                    for n, node in self.api.nodes.items() if node["spec"].get("unschedulable")}
        state = json.loads((self.tmp / "slurm.json").read_text())
        return {n: s["reason"] for n, s in state["nodes"].items() if s["state"] == "DRAIN"}

    def launched(self, job: str, generation: int) -> tuple[int, list[str], dict[str, str]]:
        """(times it was created, its nodes in rank order, rank 0's environment) of a generation."""
        if self.kind == "kubernetes":
            names = [f"{job}-g{generation}-r{r}" for r in range(4)]
            pods = {p["metadata"]["name"]: p for p in self.api.history}
            created = max(self.api.created.get(n, 0) for n in names)
            got = [pods[n] for n in names if n in pods]
            env = {e["name"]: e.get("value") for e in got[0]["spec"]["containers"][0]["env"]} if got else {}
            return created, [p["spec"]["nodeName"] for p in got], env
        jobs = [j for j in json.loads((self.tmp / "slurm.json").read_text())["jobs"].values()
                if j["name"] == f"transom-{job}-g{generation}"]
        handle = json.loads((self.tmp / "runs" / job / f"gen-{generation}" / "launch.json").read_text())
        assert not jobs or sorted(jobs[0]["nodes"]) == sorted(handle["nodes"])    # srun orders them its own way
        return len(jobs), handle["nodes"], {"TRANSOM_RESUME_STEP": str(handle["resume_step"])}


@pytest.fixture(params=["kubernetes", "slurm"])
def platform(request, tmp_path):
    p = Platform(request.param, tmp_path)
    try:
        yield p
    finally:
        p.close()


def controller(platform: Platform, bs: str, agents: dict, job: str | None, name: str, *,
               crash_at: str | None = None, extra: tuple = (), command: list[str] = SLEEPER) -> subprocess.Popen:
    args = [sys.executable, "-m", "transom.cli", "controller", "--bootstrap", bs, *platform.args,
            "--run-dir", str(platform.tmp / "runs"), "--precheck", "health", "--exit-when-done", *extra]
    for node in NODES:
        args += ["--node", f"{node}={agents[node]}"]
    if job:
        args += ["--job-id", job, "--world-size", "4", "--", *command]
    env = {**os.environ, **platform.env, "PYTHONUNBUFFERED": "1"}
    env.pop("TRANSOM_TEST_CRASH_AT", None)
    if crash_at:
        env["TRANSOM_TEST_CRASH_AT"] = crash_at
    return subprocess.Popen(args, env=env, stdout=open(platform.tmp / f"{name}.log", "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def ready(job: str, step: int, tier: c.Tier) -> c.CheckpointReady:
    return c.CheckpointReady(job=job, step=step, world_size=4,
                             shards=tuple(c.Shard(r, f"rank-{r}", 10, "0" * 64) for r in range(4)),
                             copies=tuple(c.Copy(r, NODES[r], tier, f"/ckpt/{step}/{r}") for r in range(4)),
                             replicated=False, persisted=tier != c.Tier.MEMORY, ts=time.time())


def kill(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def test_xid_evicts_on_the_platform_and_resumes_from_the_newest_surviving_checkpoint(broker, agents, platform):
    job, bs = f"xid-{platform.kind[:4]}", broker.bootstrap
    first = controller(platform, bs, agents, job, "first", crash_at="evicting")
    second = None
    try:
        until_alive(first, lambda: 0 in launches(lifecycle(bs, job)), 60, "the first launch")
        producer = make_producer(bs)
        publish(producer, c.CHECKPOINTS, job, ready(job, 10, c.Tier.SHARED))
        publish(producer, c.CHECKPOINTS, job, ready(job, 20, c.Tier.MEMORY))
        producer.flush(10)
        until_alive(first, lambda: [e for e in lifecycle(bs, job) if e.name == "checkpoint" and e.detail["step"] == 20],
              30, "the checkpoints")
        f = fault(job, "node1")
        send(bs, f, f)
        assert first.wait(60) == -signal.SIGKILL           # killed by the test hook after the eviction
        second = controller(platform, bs, agents, job, "second")
        assert finish(second, 90) == 0
    finally:
        kill(first, *(p for p in (second,) if p))
    events = lifecycle(bs, job)
    names = [e.name for e in events]
    assert names.count("relaunching") == 1 and launches(events) == [0, 1] and names[-1] == "completed", names
    assert platform.cordoned() == {"node1": "xid-on-node1" if platform.kind == "kubernetes" else "xid on node1"}
    created, nodes, env = platform.launched(job, 1)
    assert created == 1 and nodes == ["node0", "node4", "node2", "node3"]
    assert env["TRANSOM_RESUME_STEP"] == "10"                # step 20's rank-1 copy died with node1


def cli(bs: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transom.cli", args[0], "--bootstrap", bs, *args[1:]],
                          capture_output=True, text=True, timeout=60)


def test_run_submits_a_relaunch_survives_a_controller_crash_and_the_budget_fails_the_job(broker, agents, platform):
    """``transom run`` submits; the controller dies right after relaunching; ``transom jobs`` tells the story."""
    job, bs = f"hang-{platform.kind[:4]}", broker.bootstrap
    first = controller(platform, bs, agents, None, "first", crash_at="relaunching")
    second = None
    try:
        submit = cli(bs, "run", "--nodes", "4", "--spares", "1", "--max-restarts", "1", "--job-id", job, "--",
                     *SLEEPER)
        assert submit.returncode == 0 and submit.stdout.strip() == job, submit.stderr
        until_alive(first, lambda: 0 in launches(lifecycle(bs, job)), 60, "the first launch")
        send(bs, fault(job, "node2", c.FaultKind.HANG))
        assert first.wait(60) == -signal.SIGKILL           # killed right after launching generation 1
        second = controller(platform, bs, agents, None, "second")
        until_alive(second, lambda: 1 in launches(lifecycle(bs, job)), 60, "the adopted relaunch")
        send(bs, fault(job, "node3", c.FaultKind.HANG))
        assert finish(second, 60) == 1
    finally:
        kill(first, *(p for p in (second,) if p))
    events = lifecycle(bs, job)
    assert launches(events) == [0, 1]
    created, nodes, _ = platform.launched(job, 1)
    assert created == 1 and nodes == NODES[:4]                # restarted in place, created once
    assert events[-1].name == "failed" and "restart budget of 1" in events[-1].detail["reason"]
    assert platform.cordoned() == {}
    if platform.kind == "kubernetes":
        assert not [k for k in platform.api.pods if k[1].startswith(f"{job}-g1")]    # stopped: pods deleted
    listed = cli(bs, "jobs").stdout
    assert any(line.split()[:2] == [job, "failed"] for line in listed.splitlines()), listed
    shown = cli(bs, "jobs", "show", job).stdout
    assert [line.split()[2] for line in shown.splitlines()] == [e.name for e in events]
    assert "restart budget of 1" in shown.splitlines()[-1]


def test_kubernetes_pods_deleted_behind_the_controllers_back_fail_the_generation_and_the_job_recovers(
        broker, agents, tmp_path):
    """Pods that vanish (an operator's drain, a node gone) are a failed generation, restarted in place."""
    platform = Platform("kubernetes", tmp_path)
    job, bs = "vanish-kube", broker.bootstrap
    first_gen_sleeps = [sys.executable, "-c",
                        "import os, time; time.sleep(300 if os.environ['TRANSOM_GENERATION'] == '0' else 0)"]
    proc = controller(platform, bs, agents, job, "ctl", command=first_gen_sleeps)
    try:
        until_alive(proc, lambda: 0 in launches(lifecycle(bs, job)), 60, "the first launch")
        until_alive(proc, lambda: len([k for k in platform.api.procs if k[1].startswith(f"{job}-g0")]) == 4, 30,
                    "generation 0's pods to run")
        assert len(platform.api.delete_pods(f"{job}-g0")) == 4
        assert finish(proc, 90) == 0
    finally:
        kill(proc)
        platform.close()
    events = lifecycle(bs, job)
    assert launches(events) == [0, 1] and events[-1].name == "completed", [e.name for e in events]
    assert not [k for k in platform.api.services if k[1] == f"{job}-g0"]     # the stopped generation's Service
