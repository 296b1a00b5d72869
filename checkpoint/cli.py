"""``transom ckpt``, ``transom ckpt-server``: the checkpoint engine's commands.

``transom ckpt-server --node NODE`` runs the node's TCE daemon (:mod:`.server`) until SIGTERM.
``transom ckpt plan --params P --dp DP --nodes N`` prints the paper's per-node memory and load
time; with ``--check`` it also compares this node's /dev/shm and RAM and exits 2 with the reason
when they cannot hold the checkpoints. ``transom ckpt plan --save-cost C --mtbf M [--step-time T]
[--rollback-share P]`` prints the checkpoint interval that loses the least training time (Young's,
:mod:`.cadence`) and what it loses.

``transom ckpt list --dir D [--verify]`` prints one line per step dir: complete steps (those
with manifest.json) and incomplete ones, flagged. With ``--verify`` every shard of a complete
step is checked against its digest and size; the exit status is 1 when one fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime

__all__ = ["register"]


def register(sub) -> None:
    ckpt = sub.add_parser("ckpt", help="inspect checkpoints written by the checkpoint engine",
                          description="Inspect checkpoints written by the checkpoint engine (TCE).")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", metavar="SUBCOMMAND")
    ckpt_sub.required = True
    p = ckpt_sub.add_parser(
        "list", help="list complete and incomplete checkpoint steps of a directory",
        description="List the step dirs of a checkpoint directory: complete ones (manifest.json "
                    "present) and incomplete ones, flagged.")
    p.add_argument("--dir", default=os.environ.get("TRANSOM_CKPT_DIR") or None, metavar="DIR",
                   help="checkpoint directory (env TRANSOM_CKPT_DIR)")
    p.add_argument("--verify", action="store_true",
                   help="check every shard of complete steps against its size and digest")
    p.set_defaults(func=_list)

    pl = ckpt_sub.add_parser(
        "plan", help="per-node checkpoint memory and load time, and the checkpoint interval",
        description="With --params, --dp, --nodes: the memory one node needs for checkpoints and the "
                    "expected load time, from the TRANSOM paper's model (--check also tests this node's "
                    "/dev/shm and RAM). With --save-cost: the checkpoint interval that loses the least "
                    "training time, sqrt(2 x save cost x MTBF / rollback share) (Young), and what it loses; "
                    "a running job measures its save cost and rollback share and does this itself "
                    "(train_lm --ckpt-every auto, CheckpointEngine.due).")
    pl.add_argument("--params", type=float, default=None, help="model parameters, e.g. 7e9")
    pl.add_argument("--dp", type=int, default=None, help="data-parallel degree")
    pl.add_argument("--nodes", type=int, default=None, help="number of nodes")
    pl.add_argument("--save-cost", type=float, default=None, metavar="SECONDS",
                    help="training time one save costs: its stall plus the slowdown of the steps while it "
                         "replicates and persists (the ckpt_stall_s a job reports is the lower bound)")
    pl.add_argument("--mtbf", type=float, default=None, metavar="SECONDS",
                    help="mean time between faults, any kind (default: TRANSOM_CKPT_MTBF_S, else 4 h)")
    pl.add_argument("--step-time", type=float, default=None, metavar="SECONDS",
                    help="training step time: print the interval in steps too")
    pl.add_argument("--rollback-share", type=float, default=1.0, metavar="P",
                    help="share of those faults that relaunch the job from its checkpoint, in (0, 1] (default 1: "
                         "every fault; a job that heals faults in place rolls back only on a fallback, and a "
                         "running job learns this share from its own heals and relaunches)")
    pl.add_argument("--b-mem", type=float, default=10e9, help="host memory bandwidth, bytes/s (default 10e9)")
    pl.add_argument("--b-rdma", type=float, default=12.5e9, help="RDMA bandwidth, bytes/s (default 12.5e9)")
    pl.add_argument("--mem-keep", type=int, default=1, help="in-memory copies kept besides the one being "
                                                             "written (default 1)")
    pl.add_argument("--check", action="store_true", help="check this node's /dev/shm and RAM; exit 2 if short")
    pl.add_argument("--runtime", default=None, help="runtime dir whose filesystem is checked "
                                                    "(env TRANSOM_CKPT_RUNTIME; default /dev/shm/...)")
    pl.set_defaults(func=_plan)

    srv = sub.add_parser("ckpt-server", help="run this node's checkpoint daemon (TCE)",
                         description="Run a node's TCE daemon: owns the shared-memory segments ranks "
                                     "checkpoint into, replicates them to the ring neighbour's daemon, "
                                     "persists them and announces complete checkpoints.")
    srv.add_argument("--node", required=True, help="node id (ranks find the daemon by TRANSOM_NODE)")
    srv.add_argument("--runtime", default=None, help="runtime dir shared by the node's daemons and ranks "
                                                     "(env TRANSOM_CKPT_RUNTIME; default /dev/shm/transom-ckpt-UID-HASH, HASH naming the stack's --bootstrap)")
    srv.add_argument("--disk-dir", default=None, help="local disk dir for persisted shards "
                                                      "(env TRANSOM_CKPT_LOCAL_DIR; default /tmp/transom-ckpt-local-UID-HASH)")
    srv.add_argument("--host", "--bind", dest="host", default=None,
                     help="address to listen on (0.0.0.0: every interface; default: the address of the "
                          "interface that routes to the broker, every interface when --advertise is given, "
                          "127.0.0.1 without a broker or with one on loopback)")
    srv.add_argument("--advertise", default=os.environ.get("TRANSOM_ADVERTISE_ADDR") or None, metavar="ADDR",
                     help="address peers on other hosts connect to, published in the service registry (env "
                          "TRANSOM_ADVERTISE_ADDR; default: the bind address if it is a specific one, else the "
                          "address of the interface that routes to the broker; never 0.0.0.0)")
    srv.add_argument("--port", type=int, default=0, help="port to listen on (default: any free port)")
    srv.add_argument("--transport", default=os.environ.get("TRANSOM_CKPT_TRANSPORT", "auto"),
                     choices=("auto", "mooncake", "tcp"),
                     help="replication transport (env TRANSOM_CKPT_TRANSPORT; default auto: Mooncake's RDMA "
                          "where an RDMA port is active, Transom's TCP transport otherwise)")
    srv.add_argument("--protocol", default="auto", choices=("auto", "tcp", "rdma"),
                     help="Mooncake protocol (default auto: rdma where /sys/class/infiniband has an active port)")
    srv.add_argument("--stop-timeout", type=float, default=30.0,
                     help="on SIGTERM, seconds to finish the staged saves before exiting (default 30)")
    srv.add_argument("--mem-keep", type=int, default=1, help="newest in-memory copies kept per rank (default 1)")
    srv.add_argument("--disk-keep", type=int, default=3, help="newest local-disk steps kept per job (default 3)")
    srv.add_argument("--max-bytes", type=int, default=_env_bytes(), help="shared-memory budget in bytes "
                                                                        "(env TRANSOM_CKPT_SHM_BYTES; default: no budget)")
    srv.add_argument("--bootstrap", default=os.environ.get("TRANSOM_BOOTSTRAP") or None,
                     help="Kafka bootstrap (env TRANSOM_BOOTSTRAP): the service registry where daemons find "
                          "their ring neighbour, and checkpoint-ready events when the rank gives none; "
                          "without one, daemons of one host find each other in the runtime dir")
    srv.set_defaults(func=_serve)


def _env_bytes() -> int | None:
    raw = os.environ.get("TRANSOM_CKPT_SHM_BYTES")
    if not raw:
        return None
    try:
        return int(float(raw))
    except ValueError:
        from transom.config import ConfigError
        raise ConfigError(f"TRANSOM_CKPT_SHM_BYTES: expected a number of bytes, got {raw!r}") from None


def _serve(args: argparse.Namespace) -> int:
    from transom.log import setup

    from .server import main

    setup()
    return main(args)


def _plan(args: argparse.Namespace) -> int:
    from transom.config import ConfigError, env_float

    from . import cadence, planner, segments

    memory = (args.params, args.dp, args.nodes)
    if args.save_cost is None and None in memory:
        raise ConfigError("plan: give --params, --dp and --nodes (memory and load time), "
                          "--save-cost (the checkpoint interval), or both")
    if args.save_cost is not None:
        mtbf = args.mtbf if args.mtbf is not None else env_float("TRANSOM_CKPT_MTBF_S", cadence.DEFAULT_MTBF_S)
        if not args.save_cost >= 0:
            raise ConfigError(f"plan: --save-cost {args.save_cost}: expected seconds >= 0")
        for key, value in (("--mtbf", mtbf), ("--step-time", args.step_time)):
            if value is not None and not value > 0:
                raise ConfigError(f"plan: {key} {value}: expected seconds > 0")
        if not 0 < args.rollback_share <= 1:
            raise ConfigError(f"plan: --rollback-share {args.rollback_share}: expected a share in (0, 1]")
        share = args.rollback_share
        iv = cadence.plan(args.save_cost, mtbf, args.step_time, rollback_share=share)
        steps = f" = {iv.steps} steps of {args.step_time:g} s" if iv.steps is not None else ""
        rollbacks = f", {100 * share:g} % of them rolled back: one every {mtbf / share:g} s" if share < 1 else ""
        print(f"save cost {args.save_cost:g} s, a fault every {mtbf:g} s{rollbacks}")
        print(f"checkpoint interval sqrt(2 x cost x MTBF / share): {iv.seconds:10.1f} s{steps}")
        print(f"training time lost to saves (cost / interval):     {100 * iv.save_fraction:10.2f} %")
        print(f"lost to recomputation (share x interval / 2 MTBF): {100 * iv.rollback_fraction:10.2f} %")
        print(f"lost in all:                                       {100 * iv.lost_fraction:10.2f} %")
    if None in memory:
        return 0
    p = planner.plan(args.params, args.dp, args.nodes, b_mem=args.b_mem, b_rdma=args.b_rdma,
                     mem_keep=args.mem_keep)
    gib = 1 << 30
    print(f"model {args.params:.3g} parameters, DP {args.dp}, {args.nodes} nodes")
    print(f"checkpoint bytes per node, max(S_save) = (DP+6)*P/(4N): {p.s_save / gib:10.2f} GiB")
    print(f"with {args.mem_keep} kept + 1 being written:                 {p.per_node / gib:10.2f} GiB")
    print(f"expected load time:                                {p.load_s:10.2f} s")
    if args.check:
        runtime = segments.runtime_dir(args.runtime)
        probe = runtime if runtime.exists() else runtime.parent
        shm, ram = planner.local_limits(probe)
        try:
            planner.check_node(int(p.per_node), shm_free=shm, ram_available=ram, budget=_env_bytes(),
                               where=str(probe))
        except planner.CapacityError as exc:
            print(f"transom ckpt plan: {exc}", file=sys.stderr)
            return 2
        print(f"this node: {shm / gib:.2f} GiB free in {probe}, {ram / gib:.2f} GiB RAM available: fits")
    return 0


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _list(args: argparse.Namespace) -> int:
    from transom.config import ConfigError

    if not args.dir:
        raise ConfigError("no checkpoint directory: pass --dir or set TRANSOM_CKPT_DIR")
    if not os.path.isdir(args.dir):
        print(f"transom ckpt list: {args.dir}: no such directory", file=sys.stderr)
        return 1

    from transom import contracts
    from transom.checkpoint import layout, store
    from transom.checkpoint.errors import CorruptCheckpoint

    steps = layout.list_steps(args.dir)
    if not steps:
        print(f"no checkpoints in {args.dir}")
        return 0
    bad = 0
    print(f"{'STEP':>10}  {'STATUS':<10}  {'RANKS':>7}  {'SIZE':>10}  {'GEN':>4}  COMMITTED")
    for s in steps:
        world = s.world_size if s.world_size is not None else "?"
        status, when, notes = ("complete" if s.complete else "INCOMPLETE"), "-", []
        if s.complete:
            try:
                man = layout.read_manifest(s.path)
                when = datetime.fromtimestamp(man.ts).isoformat(timespec="seconds")
                ranks = f"{len(man.shards)}/{man.world_size}"
                if args.verify:
                    for shard in man.shards:
                        try:
                            store.verify_shard(s.path, shard)
                        except CorruptCheckpoint as exc:
                            notes.append(str(exc))
                    status = "CORRUPT" if notes else "verified"
            except (OSError, contracts.ContractError) as exc:
                status, ranks = "CORRUPT", f"?/{world}"
                notes.append(f"{s.path / layout.MANIFEST}: unreadable manifest: {exc}")
        else:
            ranks = f"{len(s.ranks)}/{world}"
        bad += bool(notes)
        gen = "-" if s.generation is None else s.generation
        print(f"{s.step:>10}  {status:<10}  {ranks:>7}  {_human(s.size):>10}  {gen:>4}  {when}")
        for note in notes:
            print(f"{'':>12}{note}")
    done = sum(s.complete for s in steps)
    print(f"{done} complete, {len(steps) - done} incomplete step(s) in {args.dir}")
    return 1 if bad else 0
