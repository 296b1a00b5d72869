"""Elastic process groups: the survivors of a rank failure keep their processes and state; a warm spare steps in.

The training side of in-job recovery (issue 17; the controller's side is the ``healing`` step of
:mod:`transom.controller.state`). A training loop uses it in three places::

    group = ElasticGroup.from_env()      # None outside Transom (no job, no broker): plain torch.distributed
    group.join()                         # init the process group; a warm spare blocks here until it is
                                         # assigned a rank (RANK, WORLD_SIZE, MASTER_* are set then)
    replica = MyReplica(model, opt, ...) # what data-parallel replicas hold alike, and the per-rank position
    if group.spare:
        group.sync(replica)              # the spare: model, optimizer and step from a survivor
    while replica.step < steps:
        out = group.step(fn, replica)    # fn: one training step; a collective failure inside it is healed

:meth:`ElasticGroup.step` runs ``fn``. When a collective raises (gloo fails within milliseconds
when a peer process dies; a stuck peer is killed by the controller, which fails it the same way),
the rank drops the broken group (``Replica.drop``, then aborts it; a group whose collective is still
pending is kept aside instead, see :meth:`ElasticGroup.close`), waits for the controller to name the
new group, joins it with a fresh rendezvous, runs :meth:`sync`, rebuilds (``Replica.rebuild``) and
redoes the step once, from the same per-rank position (``Replica.position``/``rewind``). Survivors
load no checkpoint. ``group.close()`` at the end (also run at the interpreter's exit) lets a rank
exit at once even while such a kept group still waits on a peer.

:meth:`sync` (collective, every rank of the new group): all ranks exchange their step counters;
the lowest rank among those with the highest counter (a survivor; a spare counts -1) broadcasts
the model's parameters and buffers (in place, bit for bit), the optimizer's state and the step
counter; a rank behind it loads them. A spare then brings its own per-rank position (data stream,
RNG) to that step (``Replica.adopt``: from the newest checkpoint of its rank, or from scratch).
Every rank logs ``elastic: rank R epoch E step S params sha256 H optimizer xxh3 O`` after a sync.

Control channel (across hosts: the broker is what every host reaches; the rendezvous address is
the one the controller's backend gives for rank 0's node, never one a rank made up):

- rank -> controller: ``transom.lifecycle`` under the key ``__elastic__JOB``, events ``elastic_joined``
  (rank, node, generation, pid), ``spare_ready`` (node, generation, pid), ``collective_failed`` (rank,
  epoch, step: a collective of this rank failed, so a peer is likely gone; the controller looks at the
  ranks at once instead of at its next poll) and ``elastic_synced`` (epoch, step: the new group holds
  one state; the heal is done);
- controller -> ranks: the job's timeline ``transom.history``: ``reforming`` (generation, epoch,
  master ``HOST:PORT``, world, ``assign`` node -> rank) names the new group; ``relaunching``,
  ``failed``, ``cancelled`` or ``completed`` of the job tell a waiting rank to give up.

A rank that does not hear of a new group within ``TRANSOM_REFORM_TIMEOUT_S`` (default 60 s)
raises :class:`ReformFailed` (the controller falls back to a full relaunch from the checkpoint).
Timeouts of the group: :meth:`ElasticGroup.all_reduce_mean_` (the gradients) waits in Python and
gives up when the controller names a new group (a peer gone without closing its connections leaves
gloo waiting), else after ``TRANSOM_PG_TIMEOUT_S`` (default 300 s, also the rendezvous', start-up's
and the end's); other collectives inside a step (a DDP wrapper's) time out after
``TRANSOM_STEP_TIMEOUT_S`` (default 5 s, TorchFT's own).

Exception tree::

    ElasticError(RuntimeError)      the elastic group cannot go on; the message says why
    ├── ReformFailed                no new group named in time, or the job was relaunched or ended
    ├── SpareReleased               a warm spare was told the job needs it no more (exit 0)
    └── CollectiveAbandoned         a collective given up (a new group named, or the group's timeout)
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import gc
import hashlib
import json
import os
import queue
import socket
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["ElasticGroup", "Replica", "ElasticError", "ReformFailed", "SpareReleased", "params_sha256",
           "collective_failure",
           "ENV_SPARE", "EXIT_REFORM_FAILED"]

ENV_SPARE = "TRANSOM_SPARE"
EXIT_REFORM_FAILED = 75
_GIVE_UP = ("relaunching", "failed", "cancelled", "completed")


class ElasticError(RuntimeError):
    """The elastic group cannot go on; the message says why."""


class ReformFailed(ElasticError):
    """No new group was named in time, or the job was relaunched or ended meanwhile."""


class SpareReleased(ElasticError):
    """A warm spare's job no longer needs it (it ended, or was relaunched without it)."""


class CollectiveAbandoned(ElasticError):
    """A collective of :meth:`ElasticGroup.all_reduce_mean_` was given up: a new group was named while it
    waited (a peer that is gone without closing its connections), or it passed the group's timeout."""


class Replica:
    """What a rank holds: ``model`` and ``optimizer`` (alike on every data-parallel replica), ``step``
    (steps done), and hooks for what is the rank's own. Subclass and override the hooks."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int = 0) -> None:
        self.model, self.optimizer, self.step = model, optimizer, step

    def drop(self) -> None:
        """Release every object that holds the process group (a DDP wrapper), before it is destroyed."""

    def rebuild(self) -> None:
        """Make them again over the new group (after :meth:`ElasticGroup.sync`)."""

    def position(self) -> Any:
        """This rank's own position before a step (its data stream), to redo the step from."""
        return None

    def rewind(self, position: Any) -> None:
        """Go back to ``position`` (taken before the step that failed) to redo it."""

    def adopt(self, step: int) -> None:
        """A spare that took over a rank: bring the rank's own position (data, RNG) to ``step``."""


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes as it holds them (a 0-dim tensor too), for a digest."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def params_sha256(model: torch.nn.Module) -> str:
    """sha256 of the model's parameters and buffers, in order, as bytes: equal iff bit for bit equal."""
    h = hashlib.sha256()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(name.encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def optimizer_digest(state: dict) -> str:
    """XXH3-128 of an optimizer ``state_dict()``'s tensors (in order) and of the rest of it as text: equal
    iff bit for bit equal, short of a collision (a check, not a defence; it runs in the heal's path, where
    XXH3 hashes the state of a 7M-parameter Adam in milliseconds and sha256 in tens of them)."""
    import xxhash
    h = xxhash.xxh3_128()
    for key in sorted(state.get("state", {}), key=str):
        for name, v in state["state"][key].items():
            h.update(f"{key}.{name}".encode())
            h.update(_tensor_bytes(v) if torch.is_tensor(v) else repr(v).encode())
    h.update(repr(state.get("param_groups")).encode())
    return h.hexdigest()


class _Spec:
    """A tensor's place in a broadcast: its shape and dtype (what the receivers allocate)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(t.shape), t.dtype


def _broadcast_flat(tensors: list[torch.Tensor], src: int) -> None:
    """Broadcast ``tensors`` from ``src`` into the same-shaped ``tensors`` of every other rank: one
    flattened buffer per dtype, not one collective per tensor (each costs a round trip)."""
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in group]) if dist.get_rank() == src else \
            torch.empty(sum(t.numel() for t in group), dtype=dtype)
        dist.broadcast(flat, src)
        if dist.get_rank() != src:
            at = 0
            for t in group:
                t.data.copy_(flat[at:at + t.numel()].view(t.shape))
                at += t.numel()


def _broadcast_optimizer_state(state: dict | None, src: int) -> dict:
    """``src``'s optimizer ``state_dict()`` on every rank: its layout (keys, shapes, dtypes, the
    param groups) pickled, small; its tensors as flat buffers (pickling them cost 0.3-0.5 s for 27 MB
    of Adam state on 4 ranks here, the buffers 0.04 s)."""
    mine = dist.get_rank() == src
    if mine:
        layout = {"state": {k: {n: _Spec(v) if torch.is_tensor(v) else v for n, v in st.items()}
                            for k, st in state["state"].items()},
                  "param_groups": state["param_groups"]}
    box = [layout if mine else None]
    dist.broadcast_object_list(box, src)
    layout = box[0]
    if not mine:
        state = {"state": {k: {n: torch.empty(v.shape, dtype=v.dtype) if isinstance(v, _Spec) else v
                               for n, v in st.items()} for k, st in layout["state"].items()},
                 "param_groups": layout["param_groups"]}
    _broadcast_flat([v for st in state["state"].values() for v in st.values() if torch.is_tensor(v)], src)
    return state


#: What the text of a failed collective says (gloo, NCCL, the store), beside torch's DistError types.
_COLLECTIVE_MARKS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "broken pipe",
                     "socket", "store")


def collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective (a peer gone or stuck), not an error of the step's own code."""
    if isinstance(exc, (CollectiveAbandoned, getattr(dist, "DistError", ()))):
        return True
    text = str(exc).lower()
    return any(mark in text for mark in _COLLECTIVE_MARKS)


def _await_listener(address: str, timeout: float, every: float = 0.01, most: float = 0.05) -> None:
    """Return once ``HOST:PORT`` accepts a TCP connection (or after ``timeout``; the rendezvous then fails
    with its own error). Rank 0 starts the rendezvous store in its ``init_process_group``; a rank that
    reaches the store before it listens backs off for ~0.5 s (torch's client retries with jittered
    exponential backoff), and the whole group waits for it: measured on 4 gloo ranks with rank 0 0.1 s
    late, the group formed 0.63 s after the start, 0.13 s with this wait. Tries every ``every`` seconds,
    growing to ``most`` (a large job's ranks knock on rank 0's port at most 1/``most`` times a second
    each); a name that does not resolve yet (a Kubernetes Service before its pod is ready) every 0.5 s."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return
    deadline, delay = time.monotonic() + timeout, every
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return
        except socket.gaierror:
            time.sleep(0.5)
        except OSError:
            time.sleep(delay)
            delay = min(delay * 1.5, most)


def _log(msg: str) -> None:
    print(f"elastic: {msg}", flush=True)


def _forget_default_group() -> None:
    """Unregister the default group without tearing it down (what ``_abort_process_group`` does after its
    ``abort()``): a new one can be initialised while the old one's pending work is left to time out."""
    c10d = dist.distributed_c10d
    world = c10d._world
    c10d._update_default_pg(None)
    for attr in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
                 "pg_coalesce_state"):
        getattr(world, attr).clear()
    try:
        c10d._unregister_all_process_groups()
    except Exception:                      # noqa: BLE001
        pass
    world.group_count = 0


class ElasticGroup:
    """This rank's membership of the job's process group, re-formed by the controller after a fault."""

    def __init__(self, job: str, node: str, generation: int, bootstrap: str, *, spare: bool = False,
                 pg_timeout_s: float = 300.0, step_timeout_s: float = 5.0, reform_timeout_s: float = 60.0) -> None:
        from confluent_kafka import Consumer, TopicPartition

        from transom import contracts
        from transom.kafka import CONTROL_FETCH_WAIT_MS, client_config, make_producer

        self.job, self.node, self.generation, self.bootstrap = job, node, generation, bootstrap
        self.spare = spare                       # joined as a spare: must sync before its first step
        self.pg_timeout_s, self.step_timeout_s, self.reform_timeout_s = pg_timeout_s, step_timeout_s, reform_timeout_s
        self.epoch = 0
        self.rank = int(os.environ.get("RANK") or -1)
        self.world = int(os.environ.get("WORLD_SIZE") or 0)
        self.reforms = 0
        self._contracts = contracts
        self._producer = make_producer(bootstrap, linger_ms=0)
        # the controller's answers come after this point: read the timeline from its current end on
        self._consumer = Consumer(client_config(bootstrap, group_id=f"transom-elastic-{job}-{node}-{os.getpid()}",
                                                enable_auto_commit=False, fetch_wait_max_ms=CONTROL_FETCH_WAIT_MS))
        md = self._consumer.list_topics(contracts.HISTORY, timeout=15)
        parts = []
        for p in md.topics[contracts.HISTORY].partitions:
            _lo, hi = self._consumer.get_watermark_offsets(TopicPartition(contracts.HISTORY, p), timeout=15)
            parts.append(TopicPartition(contracts.HISTORY, p, hi))
        self._consumer.assign(parts)
        self._events: "queue.Queue[dict[str, Any]]" = queue.Queue()
        self._pg: Any = None               # the group a step runs in
        self._in_init = False              # in the rendezvous of a re-formed group
        # the newest epoch the controller named for this generation (set by the reader): a collective of an
        # older group is given up, whether the rank was in it or between steps when the news came
        self._named = 0
        # groups left with a pending collective: (epoch, group, that work). Destroying one would wait for the work;
        # each is dropped (its gloo threads and sockets go with it) once its work has ended (:meth:`_bury`)
        self._graveyard: list[tuple[int, Any, Any]] = []
        self._pending: Any = None          # a collective of the current group abandoned while pending
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="transom-elastic", daemon=True)
        self._reader.start()
        atexit.register(self._outlive_pending)     # a script that never calls close() exits at once too

    @classmethod
    def from_env(cls) -> "ElasticGroup | None":
        """The group of a rank that Transom started (TRANSOM_JOB and TRANSOM_BOOTSTRAP set), else None."""
        env = os.environ
        job, bootstrap = env.get("TRANSOM_JOB"), env.get("TRANSOM_BOOTSTRAP")
        if not job or not bootstrap or env.get("TRANSOM_ELASTIC", "1") == "0":
            return None
        try:
            return cls(job, env.get("TRANSOM_NODE", ""), int(env.get("TRANSOM_GENERATION") or 0), bootstrap,
                       spare=env.get(ENV_SPARE) == "1",
                       pg_timeout_s=float(env.get("TRANSOM_PG_TIMEOUT_S") or 300.0),
                       step_timeout_s=float(env.get("TRANSOM_STEP_TIMEOUT_S") or 5.0),
                       reform_timeout_s=float(env.get("TRANSOM_REFORM_TIMEOUT_S") or 60.0))
        except Exception as exc:          # noqa: BLE001 - no control channel: train on, without in-job healing
            if env.get(ENV_SPARE) == "1":
                raise
            _log(f"no control channel at {bootstrap} ({type(exc).__name__}: {exc}): a plain process group, "
                 "every fault relaunches the job")
            return None

    # ------------------------------------------------------------------ control channel
    def _tell(self, name: str, *, wait: float = 10.0, **detail: Any) -> None:
        from transom.kafka import publish

        c = self._contracts
        ev = c.LifecycleEvent(job=self.job, seq=0, ts=time.time(), name=name, state="request",
                              detail={"node": self.node, "generation": self.generation, "pid": os.getpid(), **detail})
        # a key of its own: the topic is compacted by key, and `transom run`'s requests must not be replaced
        publish(self._producer, c.LIFECYCLE, f"__elastic__{self.job}", ev)
        self._producer.flush(wait)

    def _read(self) -> None:
        """Reader thread: the job's timeline into ``_events``. A new group named for this generation raises
        ``_named``: a collective of an older group, one this rank is blocked in (a peer that left it without
        closing its connections) or one it starts later (it was between steps when the news came: in its
        data loader, a pause, a save), is given up by :meth:`all_reduce_mean_` and the rank re-forms."""
        while not self._closed.is_set():
            try:
                msg = self._consumer.poll(0.5)     # a message returns at once; 0.5 s: how soon close() is seen
            except Exception as exc:       # noqa: BLE001 - closed under us, or the client failed for a moment
                if self._closed.is_set():
                    return
                # a reader that stopped here would leave this rank deaf to the controller's next group
                _log(f"rank {self.rank}: control channel: {type(exc).__name__}: {exc}; reading on")
                time.sleep(0.5)
                continue
            if msg is None or msg.error() or msg.key() != self.job.encode():
                continue
            try:
                ev = json.loads(msg.value())
            except ValueError:
                continue
            d = ev.get("detail") or {}
            if ev.get("name") == "reforming" and int(d.get("generation", -1)) == self.generation:
                self._named = max(self._named, int(d.get("epoch", 0)))
            if ev.get("name") in _GIVE_UP and ev.get("name") != "completed" and self._in_init:
                # relaunched (or ended) while this rank waits in a rendezvous that will never complete: it
                # is to be stopped, and a wait in C++ would not see the stop's SIGTERM; go now
                _log(f"rank {self.rank}: job {self.job} {ev.get('name')} during the re-form: exiting")
                os._exit(EXIT_REFORM_FAILED)
            if ev.get("name") == "reforming" or ev.get("name") in _GIVE_UP:
                self._events.put(ev)           # nothing else is waited for (checkpoints come every save)

    def _look_back(self) -> None:
        """A spare started as its job ended (or was relaunched) reads the timeline from a point past that news:
        the job's newest snapshot on the compacted lifecycle topic tells it, and releases it as the news would
        have (else it would wait for a rank forever)."""
        from transom.kafka import read_topic

        last = None
        try:
            # one key, one partition: the job's last message read is its newest (only that one is parsed)
            for key, value, _p, _o in read_topic(self.bootstrap, self._contracts.LIFECYCLE, timeout=30):
                if key == self.job.encode() and value is not None:
                    last = value
            newest = json.loads(last) if last is not None else {}
        except Exception as exc:               # noqa: BLE001 - the timeline's own news still releases it
            _log(f"spare on {self.node}: could not read job {self.job}'s state ({type(exc).__name__}: {exc})")
            return
        snap = (newest.get("snapshot") if isinstance(newest, dict) else None) or {}
        state = str(snap.get("state") or "")
        if state in _GIVE_UP:
            self._events.put({"name": state, "detail": {"seen": "lifecycle"}})
        elif int(snap.get("launched_generation", self.generation)) > self.generation:
            self._events.put({"name": "relaunching", "detail": {"seen": "lifecycle"}})

    def _wait_group(self, timeout: float | None) -> dict[str, Any]:
        """The next ``reforming`` of this job and generation that includes this rank (or node, for a spare)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            try:
                ev = self._events.get(timeout=0.2)
            except queue.Empty:
                continue
            d = ev.get("detail") or {}
            name = ev.get("name")
            if name in _GIVE_UP:
                if self.rank < 0:
                    raise SpareReleased(f"job {self.job} {name}: the spare on {self.node} is not needed")
                raise ReformFailed(f"job {self.job} {name} while rank {self.rank} waited for a new group")
            if name != "reforming" or int(d.get("generation", -1)) != self.generation:
                continue
            if int(d.get("epoch", 0)) <= self.epoch:
                continue
            assign = d.get("assign") or {}
            if self.rank < 0 and self.node not in assign:
                continue                         # another spare was picked: keep waiting
            if self.rank >= 0 and (taken := [n for n, r in assign.items() if int(r) == self.rank and n != self.node]):
                # this rank was counted lost (its host partitioned, or not killable) and given to a spare
                raise ReformFailed(f"rank {self.rank} of job {self.job} was given to the spare on {taken[0]}: "
                                   f"this process on {self.node} is stale and leaves")
            return d
        raise ReformFailed(f"no new group for job {self.job} within {timeout:.0f}s (rank {self.rank} on {self.node})")

    # ------------------------------------------------------------------ group
    def _init(self, master: str | None = None) -> None:
        timeout = datetime.timedelta(seconds=self.pg_timeout_s)
        env = os.environ
        rank = self.rank if master is not None else int(env.get("RANK") or 0)
        if rank != 0:
            _await_listener(master or f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}",
                            self.pg_timeout_s)
        if master is None:
            dist.init_process_group("gloo", timeout=timeout)
        else:
            dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=self.rank, world_size=self.world,
                                    timeout=timeout)
        self._pg = dist.group.WORLD
        self._pending = None

    def _take(self, d: dict[str, Any]) -> None:
        self.epoch = int(d["epoch"])
        if self.rank < 0:
            self.rank = int(d["assign"][self.node])
        self.world = int(d["world"])
        host, _, port = str(d["master"]).rpartition(":")
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world), MASTER_ADDR=host, MASTER_PORT=port,
                          LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
        os.environ.pop(ENV_SPARE, None)

    def join(self) -> None:
        """Join the job's process group. A spare announces itself and blocks until it is assigned a rank
        (:class:`SpareReleased` when the job ends or is relaunched without it)."""
        if self.spare:
            self._tell("spare_ready")
            _log(f"warm spare on {self.node} for job {self.job} generation {self.generation}: waiting for a rank")
            threading.Thread(target=self._look_back, name="transom-elastic-lookback", daemon=True).start()
            d = self._wait_group(None)
            t0 = time.monotonic()
            self._take(d)
            self._init(str(d["master"]))
            _log(f"spare on {self.node} took rank {self.rank} (epoch {self.epoch}); group formed in "
                 f"{time.monotonic() - t0:.2f}s")
        else:
            self._init()
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self._tell("elastic_joined", rank=self.rank)

    def sync(self, replica: Replica) -> int:
        """Bring every rank to the state of the most advanced survivor (collective); the step reached."""
        t0 = time.monotonic()
        mine = -1 if self.spare else replica.step
        steps = [torch.zeros(1, dtype=torch.long) for _ in range(self.world)]
        dist.all_gather(steps, torch.tensor([mine], dtype=torch.long))
        got = [int(t.item()) for t in steps]
        top = max(got)
        if top < 0:
            raise ElasticError("no rank of the new group holds the model: nothing to sync from")
        src = got.index(top)
        with torch.no_grad():
            _broadcast_flat(list(replica.model.parameters()) + list(replica.model.buffers()), src)
        state = _broadcast_optimizer_state(replica.optimizer.state_dict() if self.rank == src else None, src)
        if got[self.rank] != top:
            replica.optimizer.load_state_dict(state)
        replica.step = top
        if self.spare:
            replica.adopt(top)
            self.spare = False
        synced = time.monotonic() - t0
        _log(f"rank {self.rank} epoch {self.epoch} step {top} params sha256 {params_sha256(replica.model)} "
             f"optimizer xxh3 {optimizer_digest(replica.optimizer.state_dict())} "
             f"(state from rank {src}; synced in {synced:.2f}s)")
        if self.epoch and self.rank == src:
            self._tell("elastic_synced", rank=self.rank, epoch=self.epoch, step=top)
        return top

    def _reform(self, exc: BaseException, replica: Replica) -> None:
        t0 = time.monotonic()
        _log(f"rank {self.rank}: collective failed at step {replica.step + 1} "
             f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); dropping the group")
        named = self._named > self.epoch   # the controller has named the next group already: it knows
        if not named:
            try:
                # the survivors see a peer go within milliseconds; the controller would see its exit only at
                # its next look at the ranks (every 0.5 s by default)
                self._tell("collective_failed", wait=1.0, rank=self.rank, epoch=self.epoch, step=replica.step + 1)
            except Exception as err:      # noqa: BLE001 - the controller's own poll finds the exit all the same
                _log(f"rank {self.rank}: could not tell the controller that the collective failed: {err}")
        try:
            from transom.agents.intake import phase
            phase("restore")              # a rank waiting for its group is not hung
        except ImportError:
            pass
        replica.drop()
        if not named:
            # a model wrapper (DDP) may hold the broken group in reference cycles: collect them while the
            # controller decides (~70 ms with torch loaded), not when the next group is named and waits for us
            gc.collect()
        if self._pending is not None:
            # a collective of it still waits on a peer that is gone: tearing it down would wait too. Keep it
            # (its worker gives up at the group's timeout) and forget it as the default group
            self._graveyard.append((self.epoch, dist.group.WORLD, self._pending))
            self._pending = None
            _forget_default_group()
            _log(f"rank {self.rank}: the group of epoch {self.epoch} keeps a pending collective; it is released "
                 "when that ends (a peer's connection closes, or the group's timeout)")
        else:
            try:
                # abort, not destroy: destroy waits for the group's pending work, which a dead peer never finishes
                dist.distributed_c10d._abort_process_group()
            except Exception as err:      # noqa: BLE001 - a broken group may fail to tear down; it is dropped
                _log(f"aborting the broken group: {err}")
        self._pg = None
        d = self._wait_group(self.reform_timeout_s)
        t_named = time.monotonic()
        self._take(d)
        self._in_init = True
        try:
            self._init(str(d["master"]))
        finally:
            self._in_init = False
        self.reforms += 1
        now = time.monotonic()
        _log(f"rank {self.rank} joined group epoch {self.epoch} at {d['master']} {now - t0:.2f}s after the failure "
             f"(named after {t_named - t0:.2f}s, rendezvous {now - t_named:.2f}s)")

    def all_reduce_mean_(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` over the group in place: one flattened all-reduce, waited for here, in Python,
        so that a collective stuck on a peer that is gone is given up (:class:`CollectiveAbandoned`) as soon
        as the controller names a new group (else after the group's timeout). Use it for the gradients in
        place of DDP's reducer (which waits in C++, where nothing can interrupt it)."""
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._all_reduce(flat, dist.ReduceOp.SUM)
        flat.div_(self.world)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n

    def agree_max(self, value: int) -> int:
        """The largest ``value`` of the group's ranks, waited for as :meth:`all_reduce_mean_` (the checkpoint
        engine's ``due(step, agree=group.agree_max)`` agrees the next save step with it, inside a step)."""
        t = torch.tensor([value], dtype=torch.long)
        self._all_reduce(t, dist.ReduceOp.MAX)
        return int(t.item())

    def _all_reduce(self, flat: torch.Tensor, op: Any) -> None:
        if self._graveyard:
            self._bury()
        # no short timeout here: a peer may legitimately be late (a save's stall, an evaluation pause that one
        # rank entered a step earlier); a peer that is gone is given up when the controller names a new group
        self._timeout(self.pg_timeout_s)
        work = dist.all_reduce(flat, op=op, async_op=True)
        self._timeout(self.step_timeout_s)
        deadline = time.monotonic() + self.pg_timeout_s
        done = threading.Event()           # set by gloo's thread when the work ends: no polling latency
        work.get_future().add_done_callback(lambda _fut: done.set())
        while not done.wait(0.05):
            superseded = self._named > self.epoch
            if superseded or time.monotonic() > deadline:
                self._pending = work
                why = f"group epoch {self._named} was named" if superseded else \
                    f"no answer within {self.pg_timeout_s:.0f}s"
                raise CollectiveAbandoned(f"all-reduce of rank {self.rank} given up: {why}")
        work.wait()                        # raises what failed it

    def _bury(self) -> None:
        """Drop each group of the graveyard whose pending collective has ended (failed when the dead peer's
        connection closed, or at the group's timeout): the last reference gone, its threads and sockets go."""
        keep = [(e, g, w) for e, g, w in self._graveyard if not w.is_completed()]
        if len(keep) == len(self._graveyard):
            return
        gone = sorted({e for e, _, _ in self._graveyard} - {e for e, _, _ in keep})
        # the last references: the group's gloo threads and sockets go with them (no gc.collect: measured, the
        # threads are gone without one, and a collection costs ~70 ms inside a step)
        self._graveyard = keep
        _log(f"rank {self.rank}: released the group(s) of epoch {', '.join(map(str, gone))} "
             "(the pending collective ended)")

    def _timeout(self, seconds: float) -> None:
        """Collectives of the group time out after ``seconds``: short inside a step (a peer stuck in a broken
        group is given up on quickly), long elsewhere (start-up, rendezvous, saves and the end)."""
        try:
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))
        except (RuntimeError, ValueError, AttributeError):
            pass

    def step(self, fn: Callable[[], Any], replica: Replica, *, retries: int = 2) -> Any:
        """Run ``fn`` (one training step) and count it in ``replica.step``. A collective failure: re-form,
        sync, rebuild and redo the step (``retries`` times at most). Returns what ``fn`` returned, or None
        when another survivor had completed the failed step (this rank took that step's state instead)."""
        for attempt in range(retries + 1):
            before, pos = replica.step, replica.position()
            self._timeout(self.step_timeout_s)
            try:
                out = fn()
            except RuntimeError as exc:
                if attempt == retries or not dist.is_initialized() or not collective_failure(exc):
                    raise
                self._reform(exc, replica)
                top = self.sync(replica)
                replica.rebuild()
                try:
                    from transom.agents.intake import phase
                    phase(None)
                except ImportError:
                    pass
                if top > before:
                    return None          # a survivor had finished this step: its state is ours now
                replica.rewind(pos)
                continue
            self._timeout(self.pg_timeout_s)
            replica.step = before + 1
            return out
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Leave the control channel. Call it once the loop is done (it is also run at the interpreter's
        exit): a group left by a heal whose collective is still pending is kept past the process's end
        (:meth:`_outlive_pending`), so the rank exits at once instead of waiting out the group's timeout."""
        self._outlive_pending()
        self._closed.set()
        self._reader.join(2.0)
        try:
            self._consumer.close()
        except Exception:                 # noqa: BLE001
            pass

    def _outlive_pending(self) -> None:
        """Give each graveyard group whose collective is still pending a reference that is never dropped.

        Tearing such a group down (when its last reference goes, at the latest while the interpreter
        finalizes) waits for that collective, and it may wait on a peer that stays alive (another
        survivor, or a rank whose host did not answer the kill): the rank then exits only when that peer
        does, or at the group's timeout (``TRANSOM_PG_TIMEOUT_S``, 300 s). Measured with two gloo ranks, an
        all-reduce pending on a peer alive for 30 s: the exit took 33 s as it was (aborting the group
        does not release it either), 3.5 s with the extra reference. A group never torn down costs
        nothing at the end: its threads and sockets end with the process, and the exit status and every
        flush stay the interpreter's own. Groups whose collective has ended are released as usual."""
        if not self._graveyard:
            return
        self._bury()
        pending = self._graveyard
        if not pending:
            return
        for _epoch, pg, work in pending:
            for obj in (pg, work):
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
        self._graveyard = []
        _log(f"rank {self.rank}: the group(s) of epoch {', '.join(str(e) for e, _, _ in pending)} still wait on "
             "a peer; left to the process's end, not torn down (that would wait for the group's timeout)")
