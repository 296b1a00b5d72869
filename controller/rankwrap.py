"""Runs one training rank and records how it ended, for any controller to read.

``python -m transom.controller.rankwrap --dir D [--rank R] -- CMD...`` writes ``D/rank-R.pid``
(this wrapper's pid, which is also the process group of the rank), runs CMD with its output in
``D/rank-R.log``, and writes the exit code to ``D/rank-R.exit`` atomically. A controller that
restarts therefore learns how a rank ended even though the rank is not its child. The command is
run without a shell. Without ``--rank`` (under ``srun``) the rank, world size and node come from
``SLURM_PROCID``, ``SLURM_NTASKS`` and ``SLURMD_NODENAME``, and the node's agent intake from
``TRANSOM_AGENTS`` (``node=host:port,...``): its port on 127.0.0.1, where the node's agent listens.

Under srun, ``MASTER_ADDR`` is set here from what srun did, not by the controller: with one task
per node and block distribution, task 0 runs on the step's node 0, the first node of
``SLURM_STEP_NODELIST`` (Slurm orders a step's nodes by its node table, whatever order
``--nodelist`` gave). Its address is the host part of that node's agent address when known, else
the node name. Each task records where it ran in ``D/rank-R.node`` (JSON: node, node_id,
master_node, master_addr) for the controller's rank-to-node mapping.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys

__all__ = ["main", "write_atomic", "expand_hostlist", "slurm_master", "local_agent"]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax expanded, in order: ``n[1-3,7],gpu01`` -> n1 n2 n3 n7 gpu01."""
    out: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", text):
        if plain:
            out.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                out.append(prefix + lo)
            else:
                out += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)]
    return out


def agent_table(env: dict[str, str] | os._Environ) -> dict[str, str]:
    """``TRANSOM_AGENTS`` (``node=host:port,...``) as a dict."""
    return dict(item.split("=", 1) for item in env.get("TRANSOM_AGENTS", "").split(",") if "=" in item)


def local_agent(addr: str) -> str:
    """The intake of this node's agent as a rank under srun reaches it: its port on the loopback.

    srun runs the task on the node whose agent the table names, and the agent's intake listens on
    127.0.0.1 (never exposed to the cluster network); the table's host is the node's address for
    others (``MASTER_ADDR``)."""
    return f"127.0.0.1:{addr.rsplit(':', 1)[1]}"


def slurm_master(env: dict[str, str] | os._Environ) -> tuple[str, str]:
    """(node, address) of the step's task 0 under srun: node 0 of the step's node list."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    nodes = expand_hostlist(nodelist)
    if not nodes:
        raise RuntimeError("under srun but no SLURM_STEP_NODELIST: cannot tell where task 0 runs")
    agent = agent_table(env).get(nodes[0], "")
    addr = agent.rsplit(":", 1)[0].strip("[]") if agent else nodes[0]
    return nodes[0], addr


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m transom.controller.rankwrap",
                                description="run one training rank and record its exit code")
    p.add_argument("--dir", required=True, help="the generation's run directory")
    p.add_argument("--rank", type=int, default=None, help="the rank (default: from SLURM_PROCID, for srun)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given after --")
    if args.rank is None:
        # under srun: the task's identity comes from Slurm's environment
        if "SLURM_PROCID" not in os.environ:
            p.error("give --rank, or run under srun (SLURM_PROCID)")
        args.rank = int(os.environ["SLURM_PROCID"])
        os.environ.update(RANK=str(args.rank), WORLD_SIZE=os.environ.get("SLURM_NTASKS", "1"),
                          LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
        os.environ.setdefault("TRANSOM_NODE", os.environ.get("SLURMD_NODENAME", ""))
        table = agent_table(os.environ)                  # node=host:port,... (set by the slurm backend)
        if table.get(os.environ["TRANSOM_NODE"]):
            os.environ["TRANSOM_AGENT_ADDR"] = local_agent(table[os.environ["TRANSOM_NODE"]])
        master_node, os.environ["MASTER_ADDR"] = slurm_master(os.environ)
        write_atomic(os.path.join(args.dir, f"rank-{args.rank}.node"), json.dumps(
            {"node": os.environ.get("SLURMD_NODENAME", ""), "node_id": os.environ.get("SLURM_NODEID"),
             "master_node": master_node, "master_addr": os.environ["MASTER_ADDR"]}))
    base = os.path.join(args.dir, f"rank-{args.rank}")
    with open(f"{base}.log", "ab") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def forward(signum, _frame):
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    write_atomic(f"{base}.pid", f"{os.getpid()} {child.pid}\n")
    code = child.wait()
    write_atomic(f"{base}.exit", f"{code}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
