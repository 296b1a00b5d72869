"""``transom up``: the whole stack on this machine for one's own script, in one command.

Starts an embedded broker, one agent (simulated GPUs) and one checkpoint daemon per node, a TEE
worker and the controller, with matching addresses; prints the one ``export TRANSOM_BOOTSTRAP=...``
line other terminals need (``transom run`` from any directory then works), the nodes with their
agents' intake addresses (for ``transom inject``) and their health as the controller sees it;
then waits. Ctrl-C (SIGINT) or SIGTERM stops everything it started. A component that dies is
reported on stderr at once, with its log file.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up", help="start broker, agents, checkpoint daemons, TEE and controller on this machine",
        description="Start the whole stack on this machine for your own training script: an embedded broker, "
                    "NODES + SPARES nodes (each an agent with simulated GPUs and a checkpoint daemon), a TEE worker "
                    "and the controller. Prints the `export TRANSOM_BOOTSTRAP=...` line for other terminals and "
                    "the nodes' health; Ctrl-C stops everything. Logs: RUN_DIR/logs.",
        epilog="then, in another terminal: the printed export line, and from your script's directory "
               "`transom run --nodes 2 --spares 1 -- python train.py` (README: 'Run your own script')")
    p.add_argument("--nodes", type=int, default=2, help="nodes for ranks (default 2)")
    p.add_argument("--spares", type=int, default=1,
                   help="more nodes, kept free to replace a faulty one (default 1; total nodes: NODES + SPARES)")
    p.add_argument("--run-dir", default="transom-up",
                   help="logs, rank logs and checkpoints (default ./transom-up)")
    p.add_argument("--interval", type=float, default=1.0, help="agents' collection interval in s (default 1)")
    p.add_argument("--gpus", type=int, default=2, help="simulated GPUs per node (default 2)")
    p.set_defaults(func=run_up)


def _say(text: str) -> None:
    print(text, flush=True)


def run_up(args: argparse.Namespace) -> int:
    from transom.stack import LocalStack

    if args.nodes < 1 or args.spares < 0:
        raise SystemExit("transom up: error: --nodes must be >= 1 and --spares >= 0")
    run_dir = Path(args.run_dir).resolve()
    stack = LocalStack(run_dir, nodes=args.nodes + args.spares, gpus_per_node=args.gpus, interval=args.interval)
    stopping = threading.Event()
    got: list[int] = []

    def on_signal(signum, _frame):
        got.append(signum)
        stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        bootstrap = stack.start_broker()
        agents = stack.start_agents()
        stack.start_tee()
        stack.start_controller()
        _say(f"transom up: {len(agents)} nodes ({args.nodes} for ranks + {args.spares} spare), logs in "
             f"{run_dir / 'logs'}")
        _say(f"export TRANSOM_BOOTSTRAP={bootstrap}")
        _show_health(bootstrap, agents, stack, stopping)
        _say("ready: `transom run --nodes N [--spares S] -- python train.py` from your script's directory; "
             "Ctrl-C here stops everything")
        dead: set[str] = set()
        while not stopping.wait(1.0):
            for proc in stack.procs:
                if proc.popen.poll() is not None and proc.name not in dead:
                    dead.add(proc.name)
                    print(f"transom up: {proc.name} exited with status {proc.popen.returncode}; log: {proc.logfile}",
                          file=sys.stderr, flush=True)
        _say(f"transom up: stopping ({signal.Signals(got[0]).name if got else 'done'})")
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)     # a second Ctrl-C must not leave half the stack
        stack.stop()
        _say("transom up: stopped")


def _show_health(bootstrap: str, agents: dict[str, str], stack, stopping: threading.Event, timeout: float = 90.0):
    """Wait until the controller publishes a node view with every node healthy (or ``timeout``); print it."""
    from transom.controller.cli import _node_view

    deadline = time.monotonic() + timeout
    view = None
    while time.monotonic() < deadline and not stopping.is_set():
        if any(p.popen.poll() is not None for p in stack.procs):
            break
        view = _node_view(bootstrap)
        nodes = view.detail.get("nodes", {}) if view else {}
        if nodes and all(info.get("health") == "ok" for info in nodes.values()) and len(nodes) == len(agents):
            break
        time.sleep(1.0)
    nodes = view.detail.get("nodes", {}) if view else {}
    holder = view.detail.get("holder") if view else None
    _say(f"controller: {holder or 'not holding the lease yet'}")
    _say(f"{'NODE':<10} {'AGENT INTAKE':<22} HEALTH")
    for node, addr in agents.items():
        _say(f"{node:<10} {addr:<22} {nodes.get(node, {}).get('health', 'unknown (no node view yet)')}")
    for proc in stack.procs:
        if proc.popen.poll() is not None:
            print(f"transom up: {proc.name} exited with status {proc.popen.returncode}; log: {proc.logfile}",
                  file=sys.stderr, flush=True)
