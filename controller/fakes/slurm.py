"""Fake Slurm: ``scontrol``, ``squeue``, ``sbatch``, ``srun`` and ``scancel`` that keep the cluster in one JSON file.

:func:`install` writes the five executables into a directory (put it first on ``PATH``) and the
state file with the given nodes. What they understand (the subset the Slurm backend uses, with
Slurm's own syntax and output formats):

- ``scontrol show nodes --oneliner``: ``NodeName=X ... State=IDLE|ALLOCATED|DRAIN|DOWN Reason=...``
- ``scontrol update NodeName=X State=DRAIN|RESUME|DOWN Reason="..."``
- ``squeue --noheader --format=FMT [--name=NAME]``: running jobs (``%i`` id, ``%j`` name, ``%T`` state,
  ``%N`` nodes)
- ``srun --job-name=N --nodes=K --ntasks=K --ntasks-per-node=1 --nodelist=a,b [--exclude=c]
  [--kill-on-bad-exit=1] [--partition=P] [--export=ALL] CMD...``: refuses drained, down, excluded or
  unknown nodes as Slurm does; runs one task per node as a local process with ``SLURM_PROCID``,
  ``SLURM_NODEID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURMD_NODENAME``, ``SLURM_JOB_ID``,
  ``SLURM_STEP_NODELIST``; exits with the worst task code; with kill-on-bad-exit, a failed task
  ends the others. Tasks are numbered as the real srun numbers them: by the cluster's node table
  (the order :func:`install` was given, as slurm.conf's), not by the order of ``--nodelist``;
- ``sbatch --parsable --job-name=N --nodes=K --ntasks=K --ntasks-per-node=1 --nodelist=a,b [--exclude=c]
  [--output=F] [--chdir=D] SCRIPT``: the same checks as srun; prints the job id at once and runs
  the executable SCRIPT (its shebang) in a detached batch process (``SLURM_JOB_ID``,
  ``SLURM_JOB_NODELIST``); an ``srun`` without ``--nodelist`` inside it runs one step on the
  allocation's nodes;
- ``scancel --name=NAME`` or ``scancel ID``: SIGTERM to the job's srun or batch process, state CANCELLED.

Every task runs on this machine: the controller's agent table (``--node NAME=127.0.0.1:PORT``) is
what maps node names to addresses, as it does on a real cluster.
The state file path is in ``FAKE_SLURM_STATE`` (baked into the executables by :func:`install`).
The executables run this file with ``python -S`` (standard library only), not the package: a
command starts in a fraction of the time, and the controller runs several per poll.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["install", "main"]


@contextmanager
def _state(path: str) -> Iterator[dict]:
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(Path(path).read_text())
        yield data
        tmp = path + ".tmp"
        Path(tmp).write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)


def install(bin_dir: str | os.PathLike, state_file: str | os.PathLike, nodes: list[str]) -> dict[str, str]:
    """Write the fake executables and a fresh state; return env additions (PATH, FAKE_SLURM_STATE)."""
    bin_dir, state_file = Path(bin_dir), Path(state_file)
    bin_dir.mkdir(parents=True, exist_ok=True)
    state_file.write_text(json.dumps({"nodes": {n: {"state": "IDLE", "reason": ""} for n in nodes},
                                      "jobs": {}, "next_id": 100}))
    for tool in ("scontrol", "squeue", "sbatch", "srun", "scancel"):
        exe = bin_dir / tool
        # python -S and this file run by path: no site-packages, no transom package to import, so each
        # command starts in a fraction of the time (the controller runs several per poll)
        exe.write_text(f"#!{sys.executable} -S\nimport os, runpy, sys\nos.environ.setdefault('FAKE_SLURM_STATE', "
                       f"{str(state_file)!r})\nsys.argv[1:1] = [{tool!r}]\n"
                       f"runpy.run_path({__file__!r}, run_name='__main__')\n")
        exe.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "FAKE_SLURM_STATE": str(state_file)}


def _opts(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if "=" in arg:
            k, v = arg.split("=", 1)
        elif arg in ("--noheader", "-h", "--oneliner", "--parsable", "--overlap"):
            k, v = arg, "1"
        else:
            k, v = arg, argv[i + 1]
            i += 1
        opts[k.lstrip("-")] = v
        i += 1
    return opts, argv[i:]


def _busy(data: dict) -> set[str]:
    return {n for j in data["jobs"].values() if j["state"] == "RUNNING" for n in j["nodes"]}


def scontrol(argv: list[str], path: str) -> int:
    if argv[:2] in (["show", "nodes"], ["show", "node"]):
        with _state(path) as data:
            busy = _busy(data)
            for name, n in data["nodes"].items():
                if len(argv) > 2 and not argv[2].startswith("-") and argv[2] != name:
                    continue
                state = n["state"]
                if state == "IDLE" and name in busy:
                    state = "ALLOCATED"
                elif state == "DRAIN" and name in busy:
                    state = "DRAINING"
                reason = f" Reason={n['reason']}" if n["reason"] else ""
                print(f"NodeName={name} Arch=x86_64 CPUTot=8 State={state} Partitions=gpu{reason}")
        return 0
    if argv[:1] == ["update"]:
        kv = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
        node = kv.get("NodeName") or kv.get("nodename")
        with _state(path) as data:
            if node not in data["nodes"]:
                print(f"scontrol: error: Invalid node name specified: {node}", file=sys.stderr)
                return 1
            state = (kv.get("State") or kv.get("state") or "").upper()
            if state in ("DRAIN", "DOWN") and not (kv.get("Reason") or kv.get("reason")):
                print("scontrol: error: You must specify a reason when DOWNING or DRAINING a node. Request denied",
                      file=sys.stderr)
                return 1
            n = data["nodes"][node]
            if state == "RESUME":
                n.update(state="IDLE", reason="")
            elif state:
                n.update(state=state, reason=kv.get("Reason") or kv.get("reason") or "")
        return 0
    print(f"scontrol: error: this fake does not support {' '.join(argv)!r}", file=sys.stderr)
    return 1


def squeue(argv: list[str], path: str) -> int:
    opts, _ = _opts(argv)
    fmt = opts.get("format") or opts.get("o") or "%i %j %T %N"
    if "noheader" not in opts and "h" not in opts:
        print(fmt.replace("%i", "JOBID").replace("%j", "NAME").replace("%T", "STATE").replace("%N", "NODELIST"))
    with _state(path) as data:
        for jid, j in data["jobs"].items():
            if j["state"] != "RUNNING" or ("name" in opts and j["name"] != opts["name"]):
                continue
            print(fmt.replace("%i", jid).replace("%j", j["name"]).replace("%T", j["state"])
                  .replace("%N", ",".join(j["nodes"])))
    return 0


def scancel(argv: list[str], path: str) -> int:
    opts, rest = _opts(argv)
    with _state(path) as data:
        for jid, j in data["jobs"].items():
            if j["state"] == "RUNNING" and (jid in rest or opts.get("name") == j["name"]):
                j["state"] = "CANCELLED"
                try:
                    os.kill(j["pid"], signal.SIGTERM)
                except ProcessLookupError:
                    pass
    return 0


def _allocate(opts: dict[str, str], path: str) -> tuple[str, list[str]] | None:
    """A new RUNNING job for the request in ``opts``: (job id, its nodes in the node table's order)."""
    nodelist = [n for n in opts.get("nodelist", opts.get("w", "")).split(",") if n]
    exclude = {n for n in opts.get("exclude", opts.get("x", "")).split(",") if n}
    ntasks = int(opts.get("ntasks", opts.get("n", len(nodelist) or 1)))
    name = opts.get("job-name", opts.get("J", "srun"))
    with _state(path) as data:
        bad = [n for n in nodelist if n not in data["nodes"] or data["nodes"][n]["state"] in ("DRAIN", "DOWN")
               or n in exclude]
        if bad or len(nodelist) != ntasks:
            print(f"error: Unable to allocate resources: Requested node configuration is not available "
                  f"({','.join(bad) or 'bad request'})", file=sys.stderr)
            return None
        table = list(data["nodes"])
        nodes = sorted(nodelist, key=table.index)           # Slurm's order: the node table's, not the request's
        jid = str(data["next_id"])
        data["next_id"] += 1
        data["jobs"][jid] = {"name": name, "nodes": nodes, "state": "RUNNING", "pid": os.getpid(),
                             "submitted": time.time()}
    return jid, nodes


def _finish(path: str, jid: str, codes: list[int]) -> int:
    worst = max(codes, key=lambda c: (c != 0, abs(c))) if codes else 0
    with _state(path) as data:
        j = data["jobs"][jid]
        if j["state"] == "RUNNING":
            j["state"] = "COMPLETED" if worst == 0 else "FAILED"
        j["exit_codes"] = codes
    return 0 if worst == 0 else (worst if worst > 0 else 128 - worst)


def sbatch(argv: list[str], path: str) -> int:
    opts, rest = _opts(argv)
    if not rest:
        print("sbatch: error: this fake runs an executable batch script only (no --wrap)", file=sys.stderr)
        return 1
    got = _allocate(opts, path)
    if got is None:
        return 1
    jid, nodes = got
    out = open(opts.get("output", opts.get("o", os.devnull)), "ab")
    env = {**os.environ, "SLURM_JOB_ID": jid, "SLURM_JOB_NAME": opts.get("job-name", ""),
           "SLURM_JOB_NODELIST": ",".join(nodes), "SLURM_NNODES": str(len(nodes)), "SLURM_NTASKS": str(len(nodes)),
           "FAKE_SLURM_ALLOCATION": jid}
    proc = subprocess.Popen([sys.executable, "-S", __file__, "batch", jid, *rest],
                            env=env, cwd=opts.get("chdir") or None, stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    with _state(path) as data:
        data["jobs"][jid]["pid"] = proc.pid
    print(jid)
    return 0


def batch(jid: str, script: list[str]) -> int:
    """The batch process of job ``jid``: runs ``script`` (an argv); SIGTERM (scancel) goes to its group."""
    path = os.environ["FAKE_SLURM_STATE"]
    child = subprocess.Popen(script, start_new_session=True)

    def forward(signum, _frame):
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    return _finish(path, jid, [child.wait()])


def srun(argv: list[str], path: str) -> int:
    opts, command = _opts(argv)
    if not command:
        print("srun: error: no command", file=sys.stderr)
        return 1
    alloc = os.environ.get("FAKE_SLURM_ALLOCATION")
    if opts.get("jobid"):                        # a step of a running job's allocation (--overlap), on its nodes
        with _state(path) as data:
            job = data["jobs"].get(opts["jobid"])
            if job is None or job["state"] != "RUNNING":
                print(f"srun: error: job {opts['jobid']} is not running", file=sys.stderr)
                return 1
            want = [n for n in opts.get("nodelist", opts.get("w", "")).split(",") if n] or job["nodes"]
            jid, nodes, name = opts["jobid"], [n for n in job["nodes"] if n in want], job["name"]
        alloc = jid
    elif alloc and not opts.get("nodelist", opts.get("w")):          # a step of the batch job's allocation
        with _state(path) as data:
            jid, nodes, name = alloc, data["jobs"][alloc]["nodes"], data["jobs"][alloc]["name"]
    else:
        got = _allocate(opts, path)
        if got is None:
            return 1
        (jid, nodes), name = got, opts.get("job-name", opts.get("J", "srun"))
    procs = []
    for rank, node in enumerate(nodes):
        env = dict(os.environ)
        env.update(SLURM_PROCID=str(rank), SLURM_NODEID=str(rank), SLURM_NTASKS=str(len(nodes)), SLURM_LOCALID="0",
                   SLURMD_NODENAME=node, SLURM_JOB_ID=jid, SLURM_JOB_NAME=name, SLURM_NODELIST=",".join(nodes),
                   SLURM_JOB_NODELIST=",".join(nodes), SLURM_STEP_NODELIST=",".join(nodes))
        procs.append(subprocess.Popen(command, env=env, start_new_session=True))

    def forward(signum, _frame):
        for p in procs:
            try:
                os.killpg(p.pid, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    kill_on_bad = opts.get("kill-on-bad-exit", "0") not in ("0", "")
    codes: dict[int, int] = {}
    while len(codes) < len(procs):
        for i, p in enumerate(procs):
            if i not in codes and p.poll() is not None:
                codes[i] = p.returncode
                if p.returncode != 0 and kill_on_bad:
                    forward(signal.SIGTERM, None)
        time.sleep(0.1)
    ordered = [codes[i] for i in range(len(procs))]
    if alloc and jid == alloc:
        worst = max(ordered, key=lambda c: (c != 0, abs(c)))
        return 0 if worst == 0 else (worst if worst > 0 else 128 - worst)
    return _finish(path, jid, ordered)


def main(tool: str, argv: list[str]) -> int:
    path = os.environ.get("FAKE_SLURM_STATE")
    if not path:
        print(f"{tool}: FAKE_SLURM_STATE is not set (this is the fake Slurm of Transom's tests)", file=sys.stderr)
        return 2
    return {"scontrol": scontrol, "squeue": squeue, "sbatch": sbatch, "srun": srun, "scancel": scancel}[tool](argv, path)


if __name__ == "__main__":           # the executables install() writes: TOOL ARGS...; sbatch's batch process
    if sys.argv[1] == "batch":
        sys.exit(batch(sys.argv[2], sys.argv[3:]))
    sys.exit(main(sys.argv[1], sys.argv[2:]))
