"""The per-rank checkpoint engine: snapshot into the node daemon's memory, load the fastest copy.

``save(step, state)`` blocks only for stage 1 (snapshot): the state is laid out as one
safetensors shard (:mod:`.shardfmt`) and copied into a reused, pre-faulted shared-memory segment
that the node's TCE daemon owns (:mod:`.server`); then the daemon is told and ``save()``
returns. Hashing, replication, persistence, commit and announce run in the daemon, so a crash of
the training process after ``save()`` returns loses nothing, and tensors changed after it
returns cannot reach the checkpoint (they were copied).

The daemon is found at ``$TRANSOM_CKPT_RUNTIME/daemons/$TRANSOM_NODE.json``. Without one (a job
run outside Transom's stack) the engine starts the same daemon inside this process, says so, and
everything works except that a crash of this process takes its memory copies with it.

With ``snapshot="fork"`` (:mod:`.snapshot`) ``save()`` blocks only for a fork: a child copies
the CPU tensors from its copy-on-write view and hands the shard over; the training process pays
instead with page faults on its next writes. The default, ``copy``, blocks for the copy.

One save is in flight per rank: until the daemon has finished the previous one, a ``save()``
waits (:attr:`SavePolicy.WAIT`, default) or is dropped and logged (:attr:`SavePolicy.SKIP`). A
failed save is logged and raised by the next :meth:`CheckpointEngine.wait`; it never stops
training by itself.

Save at the fault: an engine built by :meth:`CheckpointEngine.from_env` (or with ``stop_grace``)
catches SIGTERM, the controller's stop (a kill is not caught). A SIGTERM that arrives during
``save()`` lets the snapshot finish; then, or at once when no save runs, the engine waits up to
``stop_grace`` seconds (``TRANSOM_CKPT_STOP_S``, default 8, inside the local backend's 10 s before
SIGKILL) for the in-flight save to be replicated, persisted and committed, logs what it got, and
ends the process with the signal's previous handler (by default: terminated by SIGTERM). The
node's daemon, stopped with SIGTERM too, drains its queue before it exits (:mod:`.server`).

``load()`` reads the committed manifests of ``directory`` (newest first) and, for this rank's
shard, tries its copies fastest first: memory on this node (tier 0), memory on a peer node (1;
when this rank now runs on a different node than the one that wrote the shard, the replica
holder is asked before the writer, which is presumably the evicted node), local disk (2), the
shared directory (3). Every copy's digest (:mod:`.digest`, XXH3-128 over 16 MiB chunks; sha256
for checkpoints written before) is checked while it arrives; a torn or corrupt one is skipped with a
warning and the next is used. :attr:`CheckpointEngine.last_restore` says which copy was used.
"""

from __future__ import annotations

import enum
import os
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from transom import contracts
from transom.agents.intake import phase as declare_phase
from transom.agents.intake import report_event
from transom.config import ConfigError, env_bool, env_float, env_int, env_str
from transom.log import get

from . import layout, restore, segments, shardfmt, snapshot, store
from .cadence import DEFAULT_MTBF_S, Cadence, agree_max
from .digest import StreamDigest, algorithm
from .errors import CheckpointError, CorruptCheckpoint, NoCheckpoint, StaleGeneration
from .segments import Segment
from .snapshot import SnapshotMode
from .wire import STALL_S, Conn, DaemonError, encode_msg, recv_exact_into, recv_msg, send_msg

__all__ = ["CheckpointEngine", "SavePolicy", "SnapshotMode", "TIERS"]

log = get("checkpoint")

#: restore tiers, fastest first; the index is what ``last_restore["tier"]`` and dashboards use
TIERS = ("local-memory", "peer-memory", "local-disk", "shared")


class SavePolicy(str, enum.Enum):
    """What ``save()`` does while the previous save of this rank is still in flight."""

    WAIT = "wait"      # block until it is done, then save
    SKIP = "skip"      # drop the new save, log it, return False


#: seconds a save's background work keeps asking for the next save's segment (it is free once the
#: step just saved is committed, which waits for the job's slowest rank)
AHEAD_WAIT_S = 10.0


class _Job:
    """One save's background work (the daemon's answer, the wait for the copies, the next segment),
    run by the engine's worker thread; joined like a thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.settled = threading.Event()      # the save's outcome is known (then the next segment's ask)
        self.done = threading.Event()

    def join(self, timeout: float | None = None) -> None:
        self.done.wait(timeout)

    def is_alive(self) -> bool:
        return not self.done.is_set()


class CheckpointEngine:
    """Saves and loads one rank's shard of a job's checkpoints; ``directory`` holds the manifests
    (and the shared copies when ``shared`` is true) and is shared by the job's ranks."""

    def __init__(self, directory: str | os.PathLike, job: str, rank: int, world_size: int, node: str,
                 generation: int = 0, bootstrap: str | None = None, *, keep: int = 3,
                 policy: SavePolicy | str = SavePolicy.WAIT, runtime: str | os.PathLike | None = None,
                 disk: bool = True, shared: bool = True, wait_timeout: float = 600.0,
                 snapshot: SnapshotMode | str = SnapshotMode.COPY, stop_grace: float | None = None,
                 mtbf_s: float = DEFAULT_MTBF_S, pin_memory: bool = True) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.job, self.rank, self.world_size, self.node = job, rank, world_size, node
        self.generation, self.bootstrap, self.keep = generation, bootstrap, keep
        self.policy = SavePolicy(policy)
        if not mtbf_s > 0:
            raise ConfigError(f"mtbf_s (TRANSOM_CKPT_MTBF_S): expected seconds > 0, got {mtbf_s!r}")
        #: the save schedule of :meth:`due` (:mod:`.cadence`)
        self.cadence = Cadence(mtbf_s, relaunches=generation)
        try:
            self.snapshot = SnapshotMode(snapshot)
        except ValueError:
            raise ConfigError(f"snapshot: expected one of {[m.value for m in SnapshotMode]}, "
                              f"got {snapshot!r}") from None
        self.last_snapshot_mode: SnapshotMode | None = None
        self.snapshot_child: int | None = None     # pid of the fork snapshot in flight
        self._said_cuda = False
        #: page-lock a segment before CUDA tensors are copied into it (once per segment; see
        #: :meth:`.Segment.pin_for_cuda`); off after CUDA refuses once
        self.pin_memory = bool(pin_memory)
        self._pin_next = False                # the last save had CUDA tensors: pin the next segment ahead
        self.disk, self.shared, self.wait_timeout = disk, shared, wait_timeout
        self.runtime = segments.runtime_dir(runtime, bootstrap)
        self.last_snapshot_s = 0.0
        self.last_restore: dict[str, Any] | None = None
        self.last_result: dict[str, Any] | None = None
        self.saved: list[int] = []          # steps the daemon finished for this rank
        self.committed: list[int] = []      # steps this rank's daemon committed
        self.skipped: list[int] = []        # steps dropped by SavePolicy.SKIP
        self.unpersisted: list[int] = []    # steps saved whose disk or shared write failed
        self._maps: dict[str, Segment] = {}
        self._staging = restore.Staging()   # load(into=)'s chunk buffers, touched once
        #: a refused copy had laid some of its bytes into load(into=)'s tensors before it was refused
        #: (a later successful load overwrites them; a caller left without a checkpoint re-inits them)
        self.into_touched = False
        self._thread: _Job | None = None      # the background work of the newest save
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        #: the next save's segment, acquired by the previous save's background thread (no round trip
        #: to the daemon inside save()), and that thread's own connection to the daemon: save() sends
        #: ``staged`` on it without waiting, the thread reads the answer
        self._ahead: Segment | None = None
        self._bg: Conn | None = None
        self._hurry = threading.Event()       # the training thread waits: stop acquiring ahead
        self.saves_ahead = 0                  # saves that asked the daemon nothing (segment acquired ahead)
        self._error: BaseException | None = None
        self._closed = False
        self._embedded = None
        self.directory.mkdir(parents=True, exist_ok=True)
        try:       # from now on a launch older than this one cannot commit here (see store.claim_generation)
            store.claim_generation(self.directory, job, generation, f"the start of rank {rank}")
        except StaleGeneration as exc:
            log.error("rank %d: %s", rank, exc)       # its saves will be refused; loading is harmless
        self.daemon_addr = self._find_daemon()
        self._conn = Conn(self.daemon_addr)
        self._first_of_step: set[int] = set()
        self._saving = False
        self._stop_signal: int | None = None
        self.stop_grace = stop_grace
        self._prev_handler: Any = None
        if stop_grace is not None:
            self._catch_stop()

    # ------------------------------------------------------------------ save at the fault
    def _catch_stop(self) -> None:
        import signal

        if threading.current_thread() is not threading.main_thread():
            log.warning("rank %d: save at stop is off: the engine was built outside the main thread", self.rank)
            return
        self._prev_handler = signal.signal(signal.SIGTERM, self._on_stop)

    def _on_stop(self, signum: int, _frame: Any) -> None:
        self._stop_signal = signum
        if self._saving:
            log.warning("rank %d: stopped (signal %d) during a save: finishing it first", self.rank, signum)
            return                        # save() ends with _stop_now()
        self._stop_now()

    def _stop_now(self) -> None:
        import signal

        signum, t0 = self._stop_signal or signal.SIGTERM, time.perf_counter()
        thread = self._thread
        if thread is not None and thread.is_alive():
            if not thread.settled.is_set():
                log.warning("rank %d: stopped (signal %d): waiting up to %.0f s for the in-flight save",
                            self.rank, signum, self.stop_grace)
            self._join(self.stop_grace)   # no next segment: this process is going
        if thread is None:
            log.info("rank %d: stopped (signal %d): no save in flight", self.rank, signum)
        elif thread.is_alive():
            log.error("rank %d: stopped (signal %d): the save of step %s is not done after %.1f s: exiting "
                      "anyway (its daemon keeps going)", self.rank, signum, thread.name.rsplit("-", 1)[-1],
                      time.perf_counter() - t0)
        else:
            log.warning("rank %d: stopped (signal %d): the save of step %s is %s (%.2f s): exiting", self.rank,
                        signum, thread.name.rsplit("-", 1)[-1],
                        "committed" if self.committed and self.last_result and self.last_result.get("committed")
                        else ("done" if self._error is None else f"failed: {self._error}"),
                        time.perf_counter() - t0)
        prev = self._prev_handler
        signal.signal(signum, prev if prev is not None else signal.SIG_DFL)
        if callable(prev):
            prev(signum, None)
        else:
            os.kill(os.getpid(), signum)   # the default action: the exit status says SIGTERM

    def _find_daemon(self) -> str:
        info = segments.registered(self.runtime).get(self.node)
        if info is not None:
            return info["addr"]
        from .server import CheckpointServer

        log.warning("rank %d: no TCE daemon for node %s in %s: running one inside this process "
                    "(start `transom ckpt-server --node %s` so a crash keeps the memory copies)",
                    self.rank, self.node, self.runtime, self.node)
        budget = env_str("TRANSOM_CKPT_SHM_BYTES")
        self._embedded = CheckpointServer(self.node, self.runtime, host="127.0.0.1", transport="tcp",
                                          register=False, bootstrap=self.bootstrap,
                                          max_bytes=int(float(budget)) if budget else None).start()
        return self._embedded.addr

    @classmethod
    def from_env(cls, directory: str | os.PathLike | None = None, **kwargs: Any) -> "CheckpointEngine":
        """Build from the launcher's environment (TRANSOM_CKPT_DIR, RANK, WORLD_SIZE, TRANSOM_JOB,
        TRANSOM_NODE, TRANSOM_GENERATION, TRANSOM_BOOTSTRAP, TRANSOM_CKPT_RUNTIME, TRANSOM_CKPT_SNAPSHOT,
        TRANSOM_CKPT_STOP_S: seconds a SIGTERM waits for the in-flight save, ``stop_grace``;
        TRANSOM_CKPT_PIN: 0 copies CUDA tensors into pageable memory, ``pin_memory``;
        TRANSOM_CKPT_MTBF_S: mean seconds between faults, ``mtbf_s``, for :meth:`due`, which learns the share
        of them that roll the job back);
        ``kwargs`` override."""
        directory = directory or env_str("TRANSOM_CKPT_DIR")
        if not directory:
            raise ConfigError("TRANSOM_CKPT_DIR is not set: the checkpoint engine needs a directory")
        args: dict[str, Any] = dict(
            job=env_str("TRANSOM_JOB", "local"), rank=env_int("RANK", 0),
            world_size=env_int("WORLD_SIZE", 1), node=env_str("TRANSOM_NODE", socket.gethostname()),
            generation=env_int("TRANSOM_GENERATION", 0), bootstrap=env_str("TRANSOM_BOOTSTRAP"),
            runtime=env_str("TRANSOM_CKPT_RUNTIME"), snapshot=env_str("TRANSOM_CKPT_SNAPSHOT", "copy"),
            stop_grace=float(env_str("TRANSOM_CKPT_STOP_S", "8")),
            mtbf_s=env_float("TRANSOM_CKPT_MTBF_S", DEFAULT_MTBF_S),
            pin_memory=env_bool("TRANSOM_CKPT_PIN", True))
        args.update(kwargs)
        return cls(directory, **args)

    # ------------------------------------------------------------------ save
    @property
    def pinned_bytes(self) -> int:
        """Bytes of this rank's mapped segments that are page-locked for CUDA copies."""
        return sum(seg.capacity for seg in list(self._maps.values()) if seg.pinned)

    @property
    def next_segment_ready(self) -> bool:
        """The next save's segment is acquired already (that save will not ask the daemon)."""
        return self._ahead is not None

    def in_flight(self) -> bool:
        """A save is being replicated, persisted or committed (its background thread may go on for a
        moment after that, acquiring the next save's segment)."""
        return self._thread is not None and not self._thread.settled.is_set()

    def _join(self, timeout: float | None = None) -> None:
        """Wait for the newest save's background work, cutting short its ask for the next segment."""
        if self._thread is not None:
            self._hurry.set()
            self._thread.join(timeout)
            self._hurry.clear()

    def due(self, step: int, agree: Callable[[int], int] | None = None, epoch: int | None = None) -> bool:
        """Whether to save ``step``, which just ended, by the job's cadence (:mod:`.cadence`: Young's interval
        from the measured cost of this job's saves, ``mtbf_s`` and the share of faults that relaunched the
        job rather than healed in it). Call it once per step on every rank; at
        each save step and at the first step of each ``epoch`` of the group (a heal changes it) it agrees the
        next save step across the ranks with ``agree`` (an all-reduce MAX of an int: inside an elastic step
        :meth:`transom.elastic.ElasticGroup.agree_max`, with ``epoch=group.epoch``; default:
        ``torch.distributed``'s default group when one is initialized), so every rank answers alike. An
        ``epoch`` also tells the cadence that the job heals in place (fewer faults roll it back); without
        one every fault is taken to relaunch it."""
        self.cadence.tick(step, busy=self.in_flight())
        return self.cadence.due(step, agree or agree_max, epoch)

    def save(self, step: int, state: Any) -> bool:
        """Snapshot ``state`` into the daemon's memory (blocking); False if skipped by policy.

        In ``copy`` mode it returns once every byte is in the segment; in ``fork`` mode once a
        child holding a copy-on-write view of the tensors exists (:mod:`.snapshot`)."""
        if self._closed:
            raise CheckpointError("save() after close()")
        if self.in_flight():
            if self.policy is SavePolicy.SKIP:
                self.skipped.append(step)
                log.warning("rank %d: skipped checkpoint of step %d: the save of an earlier step is "
                            "still in flight (policy skip)", self.rank, step)
                return False
            log.info("rank %d: checkpoint of step %d waits for the previous save (policy wait)", self.rank, step)
        self._join()                      # done, or about to be (the next segment's acquire)
        self._saving = True
        previous = declare_phase("checkpoint")     # the agent and the TEE see a save in progress, not a hang
        try:
            return self._save(step, state)
        finally:
            declare_phase(previous)
            self._saving = False
            if self._stop_signal is not None:
                self._stop_now()

    def _save(self, step: int, state: Any) -> bool:
        t0 = time.perf_counter()
        plan = shardfmt.plan(state)                                      # stage 1: snapshot
        seg, self._ahead = self._ahead, None
        if seg is not None and seg.capacity < plan.size:                # the state grew: a bigger one
            self._give_back(seg)
            seg = None
        if seg is not None:
            self.saves_ahead += 1
        else:
            seg = self._segment(self._conn.call({"op": "acquire", "job": self.job, "rank": self.rank, "step": step,
                                                 "size": plan.size, "ckpt_dir": str(self.directory),
                                                 "generation": self.generation})["path"])
        self._pin_next = self.pin_memory and plan.on_cuda
        if self._pin_next:
            self._pin(seg)
        msg = {"op": "staged", "path": str(seg.path), "job": self.job, "rank": self.rank, "step": step,
               "size": plan.size, "world_size": self.world_size, "generation": self.generation,
               "ckpt_dir": str(self.directory), "bootstrap": self.bootstrap, "keep": self.keep,
               "disk": self.disk, "shared": self.shared}
        pid, handed = None, False
        try:
            lock = snapshot.lock_segment(str(seg.path))
            try:
                if self.snapshot is SnapshotMode.FORK:
                    pid = self._fork(seg, plan, msg, lock)
                if pid == -1:                    # the fork failed; _fork copied and handed it over
                    pid, lock = None, -1
                elif pid is None:
                    shardfmt.write_into(seg.view(plan.size), plan)
                    self._hand_over(msg)
                    handed = True
            finally:
                if pid is None and lock >= 0:
                    os.close(lock)
        except BaseException:
            if pid is None:
                self._conn.call({"op": "abort", "path": str(seg.path)})
            raise
        self.last_snapshot_s = time.perf_counter() - t0
        self.cadence.saved(step, self.last_snapshot_s)
        self.last_snapshot_mode = SnapshotMode.COPY if pid is None else SnapshotMode.FORK
        report_event("checkpoint_save", step=step, ckpt_stall_s=self.last_snapshot_s, ckpt_bytes=plan.size)
        self.snapshot_child = pid
        self._thread = _Job(f"ckpt-wait-{step}")
        self._jobs.put((self._thread, (step, pid, str(seg.path), plan.size, handed)))
        if self._worker is None:          # one thread for every save's background work (a thread start
            self._worker = threading.Thread(target=self._work, name=f"ckpt-rank-{self.rank}", daemon=True)
            self._worker.start()          # inside save() costs ms on a busy host)
        return True

    def _hand_over(self, msg: dict) -> None:
        """Send ``staged`` on the background connection without waiting for the answer: the daemon
        takes the shard from here on; the save's background thread reads whether it was accepted."""
        try:
            if self._bg is None:
                self._bg = Conn(self.daemon_addr, timeout=10)
            self._bg.send(msg)
        except DaemonError:
            self._drop_bg()
            raise

    def _drop_bg(self) -> None:
        if self._bg is not None:
            self._bg.close()
            self._bg = None

    def _give_back(self, seg: Segment) -> None:
        """Return an unused segment acquired ahead to the daemon's free list."""
        try:
            self._conn.call({"op": "abort", "path": str(seg.path)})
        except (DaemonError, OSError) as exc:
            log.debug("rank %d: returning %s: %s", self.rank, seg.path, exc)

    def _acquire_ahead(self, conn: Conn, size: int) -> None:
        """Acquire the next save's segment now (off the training thread), sized like this one. The
        daemon has one to spare once the step just saved is committed (every rank's shard persisted):
        asked once, then again after 0.1, 0.2, 0.4 ... (at most 2) s for up to :data:`AHEAD_WAIT_S` or
        until the training thread wants the engine (``save()``, ``wait()``, a stop), which then asks
        itself."""
        deadline, pause = time.monotonic() + AHEAD_WAIT_S, 0.1
        try:
            while True:                   # once at least: the segment is usually free by now
                got = conn.call({"op": "acquire", "job": self.job, "rank": self.rank, "step": None, "size": size,
                                 "ckpt_dir": str(self.directory), "generation": self.generation})
                if got.get("path"):       # None: no segment to spare yet
                    seg = self._segment(got["path"])
                    if self._pin_next:
                        self._pin(seg)    # before save() can take it: off the training thread
                    self._ahead = seg
                    return
                # backing off: each ask lists the job's checkpoint directory (a shared file system's
                # metadata server serves every rank of the job)
                if self._hurry.wait(pause) or time.monotonic() > deadline:
                    return
                pause = min(pause * 2, 2.0)
        except (DaemonError, OSError, ValueError) as exc:
            log.info("rank %d: the next save's segment was not acquired ahead (the save will ask for one): "
                     "%s", self.rank, exc)

    def _fork(self, seg: Segment, plan: shardfmt.ShardPlan, msg: dict, lock: int) -> int | None:
        """Copy what a child cannot, fork one for the rest; its pid, or None to copy here instead."""
        parent, child = snapshot.partition(plan.tensors, plan.offsets, seg.addr)
        if not child:
            return None                      # nothing big on the CPU: a fork would only cost
        if plan.on_cuda and not self._said_cuda:
            self._said_cuda = True
            log.info("rank %d: fork snapshot: CUDA tensors are copied to the staging memory before the "
                     "fork (a child cannot see device memory); CPU tensors are snapshotted copy-on-write",
                     self.rank)
        shardfmt.write_into(seg.view(plan.size), plan, only=parent)
        conn = Conn(self.daemon_addr, timeout=10)         # authenticated here: no crypto in the child
        job = snapshot.ForkJob(seg.addr, plan.size, child, conn.sock.fileno(), encode_msg(msg))
        try:
            return snapshot.fork_copy(job, lock)
        except OSError as exc:
            log.error("rank %d: fork snapshot failed (%s): copying in the training process instead, "
                      "from now on", self.rank, exc)
            self.snapshot = SnapshotMode.COPY
            shardfmt.write_into(seg.view(plan.size), plan)
            self._conn.call(msg)
            os.close(lock)
            return -1
        finally:
            conn.close()                 # the child has its own copy of the connection

    def reserve(self, state: Any) -> int:
        """Have the daemon create (and this rank map) a segment big enough for ``state`` now, so
        that the first ``save()`` already copies into warm memory; return its size in bytes."""
        plan = shardfmt.plan(state)
        got = self._conn.call({"op": "reserve", "job": self.job, "rank": self.rank, "size": plan.size})
        seg = self._segment(got["path"])
        if plan.on_cuda:
            self._pin(seg)
        return got["capacity"]

    def _segment(self, path: str) -> Segment:
        seg = self._maps.get(path)
        if seg is None:
            seg = self._maps[path] = Segment.open(path)
        return seg

    def _pin(self, seg: Segment) -> None:
        """Page-lock ``seg`` for the device-to-host copies of CUDA tensors; where CUDA refuses, say so
        once and copy into pageable memory from then on (slower, never wrong)."""
        if not self.pin_memory or seg.pinned:
            return
        try:
            t0 = time.perf_counter()
            seg.pin_for_cuda()
            log.debug("rank %d: %s page-locked in %.3f s", self.rank, seg.path, time.perf_counter() - t0)
        except (OSError, RuntimeError) as exc:
            self.pin_memory = self._pin_next = False
            log.warning("rank %d: cannot page-lock the checkpoint segment for CUDA copies (%s): copying "
                        "CUDA tensors into pageable memory (about 3x slower)", self.rank, exc)

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, args = item
            try:
                self._await(job, *args)
            finally:
                job.settled.set()
                job.done.set()

    def _await(self, job: _Job, step: int, pid: int | None = None, path: str | None = None, size: int = 0,
               handed: bool = False) -> None:
        conn, own, ok = None, not handed, False
        try:
            if own:                       # a fork child (or the fork's fallback) sent staged itself
                conn = Conn(self.daemon_addr, timeout=10)
            else:
                conn = self._bg
                conn.answer("staged")
            if pid is not None:
                problem = snapshot.reap(pid)
                self.snapshot_child = None
                if problem is not None:
                    conn.call({"op": "abort", "path": path})
                    if self.snapshot is SnapshotMode.FORK:
                        self.snapshot = SnapshotMode.COPY
                        log.error("rank %d: the fork snapshot of step %d failed (%s): saving by copy "
                                  "from now on", self.rank, step, problem)
                    raise CheckpointError(f"step {step}: {problem}; nothing of this step was committed")
            got = conn.call({"op": "wait", "job": self.job, "rank": self.rank, "step": step,
                             "timeout": self.wait_timeout})
            self.last_result = got
            if got.get("failed"):
                raise CheckpointError(got["failed"])
            self.saved.append(step)
            if got.get("unpersisted"):
                self.unpersisted.append(step)
                log.warning("rank %d: step %d has no disk copy of this rank's shard (the memory copies "
                            "are valid): %s", self.rank, step, "; ".join(got["unpersisted"]))
            if got.get("committed"):
                self.committed.append(step)
            ok = True
        except BaseException as exc:  # noqa: BLE001 - kept for wait(), never kills training
            self._error = exc
            log.error("rank %d: checkpoint of step %d failed: %s", self.rank, step, exc)
            if not own:
                self._drop_bg()           # its state is unknown: the next save opens another
        finally:
            job.settled.set()
            if ok and not self._closed and size and self.snapshot is SnapshotMode.COPY:
                self._acquire_ahead(conn, size)
            if own and conn is not None:
                conn.close()

    def wait(self) -> None:
        """Block until the in-flight save is replicated, persisted (and committed, announced if this
        rank's daemon won); raise :class:`CheckpointError` if a save since the last wait() failed."""
        self._join()
        err, self._error = self._error, None
        if err is not None:
            raise CheckpointError(f"rank {self.rank}: a checkpoint save failed: {err}") from err

    def capacity(self) -> dict[str, Any]:
        """What the node's daemon reports about its memory (see :func:`.planner.check_node`)."""
        return self._conn.call({"op": "capacity"})

    def close(self) -> None:
        """Wait for the in-flight save, then drop this rank's mappings (the daemon keeps the memory)."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._ahead is not None:
                self._give_back(self._ahead)
                self._ahead = None
            self._drop_bg()
            if self._worker is not None:
                self._jobs.put(None)
            self._conn.close()
            for seg in self._maps.values():
                seg.close()
            self._maps.clear()
            if self._embedded is not None:
                self._embedded.close()

    def __enter__(self) -> "CheckpointEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ load
    def load(self, step: int | None = None, *, rank: int | None = None,
             template: Any = None, into: Any = None) -> tuple[int, Any] | None:
        """This rank's state of a committed step, as ``(step, state)``, from its fastest good copy.

        Without ``step``: the newest committed step with a good copy (a step without one is
        skipped with a warning), or None. With ``step``: that step, or :class:`NoCheckpoint`
        (absent, not committed) / :class:`CorruptCheckpoint` (no copy verifies). ``rank``: another
        rank's shard instead (data-parallel replicas: one rank saves the model, every rank loads it).
        ``template``: a state of DTensors laid out as the job runs now; they are filled in place
        from the saved pieces, re-sharded when the step was saved by another world size
        (:mod:`.sharded`).
        ``into``: a state shaped like the saved one (``{"model": model.state_dict(), "optimizer":
        opt.state_dict(), ...}``): its tensors that match a saved tensor (same place, dtype and shape,
        contiguous, CPU) are filled in place and are the returned state's tensors, so a rank whose
        model is built loads without faulting in new memory (:mod:`.restore`); it returns only once
        every byte laid into them verified. A copy refused part way may have laid some of its bytes
        into them first (:attr:`into_touched` says so): the next copy overwrites them; a caller left
        with no checkpoint must re-initialise them.
        """
        if template is not None:
            if into is not None:
                raise ValueError("load(): give template (DTensor state) or into, not both")
            return self._load_template(step, template)
        rank = self.rank if rank is None else rank
        if step is not None:
            return step, self._load_step(step, rank, into=into)
        for s in reversed(layout.complete_steps(self.directory)):
            try:
                return s, self._load_step(s, rank, into=into)
            except (CorruptCheckpoint, NoCheckpoint) as exc:
                log.warning("rank %d: skipping checkpoint step %d: %s", self.rank, s, exc)
        return None

    def _load_template(self, step: int | None, template: Any) -> tuple[int, Any] | None:
        from . import sharded

        for s in ([step] if step is not None else list(reversed(layout.complete_steps(self.directory)))):
            try:
                man = self._manifest(s, reshard=True)
                cache: dict[int, Any] = {}

                def load_rank(r: int, s: int = s) -> Any:
                    if r not in cache:
                        cache[r] = self._load_step(s, r, reshard=True)
                    return cache[r]
                state = sharded.fill(template, load_rank, man.world_size, self.rank)
                if man.world_size != self.world_size:
                    log.info("rank %d: step %d saved by %d ranks re-sharded onto %d (read the shards of ranks %s)",
                             self.rank, s, man.world_size, self.world_size, sorted(cache))
                return s, state
            except (CorruptCheckpoint, NoCheckpoint) as exc:
                if step is not None:
                    raise
                log.warning("rank %d: skipping checkpoint step %d: %s", self.rank, s, exc)
        return None

    def _manifest(self, step: int, reshard: bool = False) -> contracts.CheckpointReady:
        sdir = layout.step_dir(self.directory, step)
        if not sdir.is_dir():
            raise NoCheckpoint(f"no checkpoint of step {step} in {self.directory}")
        try:
            man = layout.read_manifest(sdir)
        except FileNotFoundError:
            raise NoCheckpoint(f"checkpoint step {step} in {sdir} is incomplete "
                               f"(no {layout.MANIFEST}: not every rank's shard was committed)") from None
        except (OSError, contracts.ContractError) as exc:
            raise CorruptCheckpoint(str(sdir / layout.MANIFEST), f"unreadable manifest: {exc}") from None
        if man.world_size != self.world_size and not reshard:
            raise NoCheckpoint(f"checkpoint step {step} in {sdir} was written by {man.world_size} "
                               f"ranks, this job has {self.world_size} (load(template=...) re-shards DTensor state)")
        return man

    def _candidates(self, step: int, man: contracts.CheckpointReady, shard: contracts.Shard) -> list:
        mine = [c for c in man.copies if c.rank == shard.rank]
        writer = next((c.node for c in mine if c.tier == contracts.Tier.DISK), None) or \
            next((c.node for c in mine if c.tier == contracts.Tier.MEMORY), None)
        out: list[tuple[int, str, Any]] = [(0, self.node, None)]
        peers = [c for c in mine if c.tier == contracts.Tier.MEMORY and c.node != self.node]
        peers.sort(key=lambda c: c.node == writer)        # the replica holder before the writer
        out += [(1, c.node, c) for c in peers]
        out += [(2, c.node, c) for c in mine if c.tier == contracts.Tier.DISK and c.node == self.node]
        # the shared copy is read from this job's directory, wherever it is mounted now
        here = str(layout.step_dir(self.directory, step) / shard.name)
        if any(c.tier == contracts.Tier.SHARED for c in mine) or Path(here).exists():
            out.append((3, "shared", contracts.Copy(shard.rank, "shared", contracts.Tier.SHARED, here)))
        return out

    def _load_step(self, step: int, rank: int, reshard: bool = False, into: Any = None) -> Any:
        man = self._manifest(step, reshard)
        shard = next((s for s in man.shards if s.rank == rank), None)
        if shard is None:
            raise NoCheckpoint(f"checkpoint step {step} has no shard of rank {rank}")
        problems = []
        for tier, node, copy in self._candidates(step, man, shard):
            t0 = time.perf_counter()
            scatter = None
            try:
                if into is not None:
                    scatter = restore.Scatter(into, shard.size, f"{TIERS[tier]} copy on {node}")
                if scatter is not None and tier == 1:
                    addr = self._resolve(node, copy)
                    if addr is None or not restore.read_peer_into(addr, self.job, shard.rank, step, shard, node,
                                                                  scatter, self._staging, STALL_S):
                        continue
                    state = scatter.finish()
                else:
                    buf = self._fetch(tier, node, copy, step, shard)
                    if buf is None:
                        continue
                    if scatter is not None:
                        scatter.put(0, memoryview(buf)[:shard.size])
                        state = scatter.finish()
                    else:
                        state = shardfmt.decode(buf, f"{TIERS[tier]} copy on {node}")
            except (CorruptCheckpoint, DaemonError, OSError) as exc:
                if scatter is not None and scatter.reused and scatter.pos > len(scatter.head):
                    self.into_touched = True
                log.warning("rank %d: step %d: %s copy on %s (of rank %d's shard) is unusable, trying the next: "
                            "%s", self.rank, step, TIERS[tier], node, rank, exc)
                problems.append(f"{TIERS[tier]}@{node}: {exc}")
                continue
            self.last_restore = {"step": step, "tier": tier, "tier_name": TIERS[tier], "node": node,
                                 "seconds": time.perf_counter() - t0, "bytes": shard.size, "rank": rank,
                                 "into_bytes": scatter.reused if scatter is not None else 0}
            log.info("rank %d: restored step %d (rank %d's shard) from %s on %s (%d bytes, %.3fs)", self.rank,
                     step, rank, TIERS[tier], node, shard.size, self.last_restore["seconds"])
            report_event("restore", restore_step=step, restore_tier=tier, restore_s=self.last_restore["seconds"],
                         restore_bytes=shard.size, restore_shard_rank=rank)
            return state
        raise CorruptCheckpoint(str(layout.step_dir(self.directory, step) / shard.name),
                                "no copy verifies: " + ("; ".join(problems) or "no copy is reachable"))

    def _resolve(self, node: str, copy: contracts.Copy) -> str | None:
        """Where ``node``'s daemon is reached now, asked of this host's daemon (it reads the service
        registry; a daemon without one, its runtime dir); None when the registry says it is gone
        (its host was lost: no connection attempt). The address recorded in the copy is the last resort."""
        try:
            got = self._conn.call({"op": "resolve", "node": node})
        except DaemonError as exc:                 # an older daemon without the request
            log.info("rank %d: cannot resolve %s through the local daemon (%s): using the recorded address",
                     self.rank, node, exc)
            return _locator_addr(copy.location)
        if got.get("addr"):
            return got["addr"]
        if got.get("source") == "registry":
            log.info("rank %d: the daemon of %s is not live in the service registry (its host is gone?): "
                     "its memory copy is skipped", self.rank, node)
            return None
        return _locator_addr(copy.location)

    def _fetch(self, tier: int, node: str, copy: contracts.Copy | None, step: int,
               shard: contracts.Shard):
        if tier == 0:
            got = self._conn.call({"op": "lookup", "job": self.job, "rank": shard.rank, "step": step,
                                   "digest": shard.checksum})
            if not got["found"]:
                return None
            seg = Segment.open(got["path"], writable=False)
            try:
                view = seg.view(min(shard.size, seg.capacity))
                try:
                    return _copy_verified(view, shard, f"{got['path']} (memory on {node})")
                finally:
                    view.release()
            finally:
                seg.close()
        if tier == 1:
            addr = self._resolve(node, copy)
            if addr is None:
                return None
            return _read_peer(addr, self.job, shard.rank, step, shard, node)
        return store.read_verified(Path(copy.location), shard)


def _locator_addr(location: str) -> str:
    return location.split("#", 1)[0]


def _check(digest: str, size: int, shard: contracts.Shard, where: str) -> None:
    if size != shard.size:
        raise CorruptCheckpoint(where, f"{size} bytes, manifest says {shard.size}")
    store.check_digest(digest, shard, where)


def _copy_verified(src: memoryview, shard: contracts.Shard, where: str):
    """A private copy of ``src`` (a segment), hashed while it is copied; refused unless it verifies."""
    if len(src) != shard.size:
        raise CorruptCheckpoint(where, f"{len(src)} bytes, manifest says {shard.size}")
    buf = segments.alloc_buffer(shard.size)
    dst, hasher, step = memoryview(buf), StreamDigest(algorithm(shard.checksum)), 64 << 20
    for lo in range(0, shard.size, step):
        dst[lo:lo + step] = src[lo:lo + step]
        hasher.feed(dst[lo:lo + step])
    _check(hasher.hexdigest(), shard.size, shard, where)
    return buf


def _read_peer(addr: str, job: str, rank: int, step: int, shard: contracts.Shard, node: str):
    """The shard from a peer daemon's memory; hashed as it arrives, refused unless it verifies.
    The buffer comes before the request: its pages are being faulted in during the round trip."""
    conn = Conn(addr, timeout=5)
    try:
        buf = segments.alloc_buffer(shard.size)
        # no SO_RCVBUF: setting it turns off the kernel's autotuning and is capped at
        # net.core.rmem_max (208 KiB by default), a window several times too small
        send_msg(conn.sock, {"op": "read", "job": job, "rank": rank, "step": step, "digest": shard.checksum})
        head = recv_msg(conn.sock)
        if not head or not head.get("found"):
            return None
        where = f"memory of {node} ({addr})"
        if head["size"] != shard.size:
            raise CorruptCheckpoint(where, f"{head['size']} bytes, manifest says {shard.size}")
        hasher = StreamDigest(algorithm(shard.checksum))
        conn.sock.settimeout(STALL_S)       # a daemon that stops sending mid-stream: the next copy
        try:
            recv_exact_into(conn.sock, memoryview(buf)[:head["size"]], hasher.feed)
        except (OSError, ValueError):
            hasher.hexdigest()
            raise
    finally:
        conn.close()
    _check(hasher.hexdigest(), head["size"], shard, where)
    return buf
