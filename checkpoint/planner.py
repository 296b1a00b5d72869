"""Capacity planner: the paper's TCE memory and load-time model, and the node check before training.

From DESIGN.md (P parameters, DP data-parallel degree, N nodes, bandwidths in bytes/s)::

    most checkpoint bytes one node holds   max(S_save) = (DP + 6) * P / (4 * N)
    load time, DP <= 8                      (DP + 6) * P / (4 * N * B_mem)
    load time, DP > 8                       3 * P / (2 * N * B_mem) + (DP - 8) * DP * P / (32 * N * B_rdma)

:func:`plan` evaluates them (times ``mem_keep + 1`` copies per shard for the staging segment
and the kept ones); :func:`check_node` compares what a node needs against its free /dev/shm,
available RAM and the configured budget and raises :class:`CapacityError` naming all three and
what to change, so a job stops before training starts instead of crashing mid-save.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import CheckpointError

__all__ = ["Plan", "plan", "CapacityError", "check_node", "node_need", "local_limits"]


class CapacityError(CheckpointError):
    """This node cannot hold the checkpoints it would be asked to hold; the message says what to change."""


@dataclass(frozen=True)
class Plan:
    params: float
    dp: int
    nodes: int
    s_save: float            # bytes one node holds for one checkpoint, paper's max(S_save)
    per_node: float          # bytes one node needs with the staging and kept copies
    load_s: float            # expected load time, paper's formula


def plan(params: float, dp: int, nodes: int, *, b_mem: float, b_rdma: float, mem_keep: int = 1) -> Plan:
    if params <= 0 or dp < 1 or nodes < 1 or b_mem <= 0 or b_rdma <= 0:
        raise ValueError("params, dp, nodes and the bandwidths must be positive")
    s_save = (dp + 6) * params / (4 * nodes)
    if dp <= 8:
        load = (dp + 6) * params / (4 * nodes * b_mem)
    else:
        load = 3 * params / (2 * nodes * b_mem) + (dp - 8) * dp * params / (32 * nodes * b_rdma)
    return Plan(params, dp, nodes, s_save, s_save * (mem_keep + 1), load)


def node_need(shard_bytes: int, ranks_on_node: int = 1, mem_keep: int = 1) -> int:
    """Bytes of shared memory a node needs: its ranks' shards and the neighbour's replicas, each
    ``mem_keep`` kept plus one being written."""
    return 2 * ranks_on_node * shard_bytes * (mem_keep + 1)


def check_node(need: int, *, shm_free: int, ram_available: int, budget: int | None = None,
               where: str = "/dev/shm") -> None:
    """Raise :class:`CapacityError` when ``need`` bytes do not fit this node."""
    gib = 1 << 30
    limits = {f"free space in {where}": shm_free, "available RAM": ram_available}
    if budget is not None:
        limits["budget (TRANSOM_CKPT_SHM_BYTES / --max-bytes)"] = budget
    short = {k: v for k, v in limits.items() if v < need}
    if short:
        have = ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in short.items())
        raise CapacityError(
            f"checkpoints need {need / gib:.2f} GiB of shared memory on this node but {have}: "
            f"lower the number of kept in-memory copies (--mem-keep), enlarge {where} "
            f"(mount -o remount,size=... {where}) or point TRANSOM_CKPT_RUNTIME at a larger tmpfs")


def local_limits(path: str | os.PathLike) -> tuple[int, int]:
    """(free bytes of the filesystem holding ``path``, available RAM)."""
    import psutil

    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, psutil.virtual_memory().available
