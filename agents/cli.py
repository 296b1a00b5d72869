"""``transom agent`` (run a node agent) and ``transom inject`` (ask an agent to inject a fault)."""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    from transom.cli import add_bootstrap

    p = sub.add_parser(
        "agent", help="run a node agent (collectors -> transom.metrics)",
        description="Collect host, GPU, NIC and training metrics every interval and publish one batch per "
                    "interval to transom.metrics, keyed by node, numbered by seq. While the broker is "
                    "unreachable, batches go to a bounded on-disk spool and are replayed in order. Training "
                    "processes report to the UDP intake (TRANSOM_AGENT_ADDR). Settings: --config FILE (TOML), "
                    "then TRANSOM_AGENT__<KEY> / TRANSOM_AGENT__<COLLECTOR>__<KEY>, then these flags. Runs "
                    "until SIGINT/SIGTERM, then delivers or spools every batch and exits 0.")
    p.add_argument("--config", default=os.environ.get("TRANSOM_AGENT_CONFIG") or None, metavar="FILE",
                   help="TOML file with [agent] and [collectors.<name>] sections (env TRANSOM_AGENT_CONFIG)")
    p.add_argument("--list-collectors", action="store_true",
                   help="list the collectors with their settings and defaults, then exit")
    p.add_argument("--node", default=None, help="this node's id, the key of its batches (env TRANSOM_NODE; "
                                                "default: host name)")
    p.add_argument("--gpu-source", choices=("nvml", "simulated", "none"), default=None,
                   help="nvml: the NVIDIA driver (without one: no GPU samples, said once); simulated: fake "
                        "GPUs for demos and tests, the only source that accepts fault injection (default: nvml)")
    p.add_argument("--gpus", type=int, default=None, help="number of simulated GPUs (default: 2)")
    p.add_argument("--seed", type=int, default=None, help="seed of the simulated GPUs' values")
    p.add_argument("--scenario", default=None, metavar="FILE",
                   help="fault scenario (TOML) played by the simulated GPUs; see docs/agent.md")
    p.add_argument("--intake-port", type=int, default=None,
                   help="UDP port of the training intake on 127.0.0.1 (default: a free port, printed)")
    p.add_argument("--interval", type=float, default=None, help="seconds between batches (default: 1.0)")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="directory for the spool and the sequence numbers (default: a temporary one, "
                        "so seq restarts at 0 and undelivered batches are lost on exit)")
    add_bootstrap(p, embedded=True)
    p.set_defaults(func=run_agent)

    q = sub.add_parser(
        "inject", help="ask an agent with simulated GPUs to inject a fault",
        description="Send a fault-injection request to an agent's intake and print its answer as JSON. "
                    "xid79: XID 79 on --gpu, after which that GPU is lost; hang: SIGSTOP every training "
                    "process that reported to the agent; straggler: SM clock and power of --gpu at 70% for good. "
                    "Only agents run with --gpu-source simulated "
                    "accept; exit status 1 when the agent refuses or does not answer.")
    q.add_argument("fault", choices=("xid79", "hang", "straggler"), help="the fault to inject")
    q.add_argument("--agent", default=os.environ.get("TRANSOM_AGENT_ADDR"), metavar="HOST:PORT",
                   help="the agent's intake address (env TRANSOM_AGENT_ADDR)")
    q.add_argument("--gpu", type=int, default=0, help="GPU index for xid79 and straggler (default: 0)")
    q.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer (default: 2)")
    q.set_defaults(func=run_inject)


def list_collectors(cfg: object | None = None) -> str:
    """The text of ``--list-collectors``: every collector, its config section, keys and defaults."""
    from .collectors import COMMON_KEYS, collector_names, registration
    from .config import describe, load_config

    cfg = cfg or load_config(env={})
    lines = [f"collectors run by default, in batch order: {', '.join(cfg.agent.collectors)}", ""]
    for name in collector_names():
        reg = registration(name)
        lines.append(f"{name}: {reg.doc}")
        lines.append(f"  [collectors.{name}]")
        for key, kind, default in describe(reg.settings):
            lines.append(f"    {key} ({kind}) = {default!r}")
        for key, what in COMMON_KEYS.items():
            lines.append(f"    {key}: {what}")
        lines.append("")
    return "\n".join(lines)


def run_agent(args: argparse.Namespace) -> int:
    from transom.broker import bootstrap_or_embedded
    from transom.cli import wait_for_signal

    from .config import load_config

    overrides = {"node": args.node, "gpu_source": args.gpu_source, "gpus": args.gpus, "seed": args.seed,
                 "scenario": args.scenario, "intake_port": args.intake_port, "interval": args.interval,
                 "state_dir": args.state_dir, "bootstrap": args.bootstrap}
    cfg = load_config(args.config, overrides=overrides)
    if args.list_collectors:
        print(list_collectors(cfg), flush=True)
        return 0
    from .agent import Agent

    with bootstrap_or_embedded(cfg.agent.bootstrap or None, args.embedded_broker) as bootstrap:
        cfg.agent.bootstrap = bootstrap
        agent = Agent(config=cfg)
        agent.start()
        try:
            print(f"agent {agent.node} intake {agent.intake_addr} bootstrap {bootstrap}", flush=True)
            wait_for_signal()
        finally:
            agent.stop()
    return 0


def run_inject(args: argparse.Namespace) -> int:
    from transom.config import ConfigError

    from .intake import IntakeError, send_inject

    if not args.agent:
        raise ConfigError("inject: give --agent HOST:PORT (or set TRANSOM_AGENT_ADDR)")
    try:
        reply = send_inject(args.agent, args.fault, gpu=args.gpu if args.fault in ("xid79", "straggler") else None,
                            timeout=args.timeout)
    except (IntakeError, TimeoutError) as exc:
        print(f"transom inject: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(reply), flush=True)
    if not reply.get("ok"):
        print(f"transom inject: refused: {reply.get('error', 'no reason given')}", file=sys.stderr)
        return 1
    return 0
