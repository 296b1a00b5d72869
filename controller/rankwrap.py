"""Runs one training rank and records how it ended, for any controller to read.

``python -m transom.controller.rankwrap --dir D [--rank R] -- CMD...`` writes ``D/rank-R.pid``
(this wrapper's pid, which is also the process group of the rank), runs CMD with its output in
``D/rank-R.log``, and writes the exit code to ``D/rank-R.exit`` atomically. A controller that
restarts therefore learns how a rank ended even though the rank is not its child. The command is
run without a shell. Without ``--rank`` (under ``srun``) the rank, world size and node come from
``SLURM_PROCID``, ``SLURM_NTASKS`` and ``SLURMD_NODENAME``, and the node's agent address from
``TRANSOM_AGENTS`` (``node=host:port,...``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

__all__ = ["main", "write_atomic"]


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
        agents = os.environ.get("TRANSOM_AGENTS")       # node=host:port,... (set by the slurm backend)
        if agents:
            table = dict(item.split("=", 1) for item in agents.split(",") if "=" in item)
            if table.get(os.environ["TRANSOM_NODE"]):
                os.environ["TRANSOM_AGENT_ADDR"] = table[os.environ["TRANSOM_NODE"]]
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
