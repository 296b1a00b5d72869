"""The local backend: every rank a real process on this machine, "nodes" simulated by name.

Each rank runs under :mod:`transom.controller.rankwrap` in its own process group, so stopping a
rank stops everything it started, and its exit code lands in a file any controller can read.
Layout of ``run_dir``::

    run_dir/JOB/gen-G/launch.json      what was launched (written once the ranks are started)
    run_dir/JOB/gen-G/rank-R.{pid,log,exit}
    run_dir/cordoned.json              nodes kept out of launches, with the reason

Each launch gets a fresh rendezvous port (gloo cannot re-form a group on the old one).

Warm ranks (``warm=True``, the default): a rank whose command is ``python -m MODULE`` or ``python
SCRIPT.py`` (this interpreter) starts in a process of :mod:`.warmrank` that has already imported
torch, instead of a new interpreter under rankwrap; the same files come out (``rank-R.pid``,
``.log``, ``.exit``). One warm process per node: those of a launch's nodes are started by the
pre-check before it; after a launch, from ``warm_delay`` seconds on, the rest one at a time (the
next once the previous says it is ready), the launch's nodes first, so their imports take little
from the running ranks. ``run_dir/warm-NODE.log`` has what a warm process said before it became
a rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import psutil

from transom.broker import free_port
from transom.log import get

from .backend import Backend, LaunchRecord, RankStatus, register_backend
from .rankwrap import write_atomic

__all__ = ["LocalBackend", "warm_argv"]

log = get("controller.local")


def warm_argv(command: Sequence[str], executable: str = sys.executable) -> list[str] | None:
    """The part of ``command`` after the interpreter when a warm process can run it, else None."""
    if len(command) < 2 or os.path.realpath(command[0]) != os.path.realpath(executable):
        return None
    if command[1] == "-m" and len(command) >= 3 and not command[2].startswith("-"):
        return list(command[1:])
    if command[1].endswith(".py") and not command[1].startswith("-"):
        return list(command[1:])
    return None


class LocalBackend(Backend):
    """Ranks as local processes; ``agents`` maps each simulated node to its agent's intake address."""

    name = "local"

    def __init__(self, run_dir: str | os.PathLike, agents: Mapping[str, str], *, ckpt_dir: str | None = None,
                 bootstrap: str | None = None, env: Mapping[str, str] | None = None, warm: bool = True,
                 preload: str = "torch", warm_delay: float = 10.0) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.agents = dict(agents)
        self.ckpt_dir = ckpt_dir
        self.bootstrap = bootstrap
        self.extra_env = dict(env or {})
        self._workers: dict[str, subprocess.Popen] = {}
        self.warm, self.preload, self.warm_delay = warm, preload, warm_delay
        self._warm: dict[str, subprocess.Popen] = {}      # node -> idle warm process
        self._running: list[subprocess.Popen] = []        # warm processes that became ranks
        self._warm_due: float | None = None
        self._warm_queue: list[str] = []                  # nodes to warm after a launch, in order

    # ------------------------------------------------------------------ paths
    def _cordoned(self) -> dict[str, str]:
        path = self.run_dir / "cordoned.json"
        return json.loads(path.read_text()) if path.exists() else {}

    # ------------------------------------------------------------------ interface
    def nodes(self) -> list[str]:
        cordoned = self._cordoned()
        return [n for n in self.agents if n not in cordoned]

    def cordon(self, node: str, reason: str) -> None:
        cordoned = self._cordoned()
        if node not in cordoned:
            cordoned[node] = reason
            write_atomic(str(self.run_dir / "cordoned.json"), json.dumps(cordoned, indent=1))
            log.info("cordoned %s: %s", node, reason)

    def launch(self, job: str, generation: int, nodes: tuple[str, ...], command: tuple[str, ...],
               resume_step: int | None) -> Mapping[str, Any]:
        record = LaunchRecord(self.run_dir, job, generation)
        if (adopted := record.adopt(log)) is not None:
            return adopted
        gen_dir = record.dir
        self._kill_strays(gen_dir)          # a launch interrupted before launch.json was written
        unknown = [n for n in nodes if n not in self.agents]
        if unknown:
            raise ValueError(f"nodes {unknown} have no agent address; known: {sorted(self.agents)}")
        port = free_port()
        ckpt_dir = self.ckpt_dir or str(self.run_dir / job / "ckpt")
        pids = []
        for rank, node in enumerate(nodes):
            env = dict(os.environ)
            env.update(self.extra_env)
            env.update({
                "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(len(nodes)),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "TRANSOM_JOB": job, "TRANSOM_NODE": node, "TRANSOM_GENERATION": str(generation),
                "TRANSOM_AGENT_ADDR": self.agents[node], "TRANSOM_CKPT_DIR": ckpt_dir,
                "PYTHONUNBUFFERED": "1",
            })
            if self.bootstrap:
                env["TRANSOM_BOOTSTRAP"] = self.bootstrap
            env.pop("TRANSOM_RESUME_STEP", None)
            if resume_step is not None:
                env["TRANSOM_RESUME_STEP"] = str(resume_step)
            pid = self._start_warm_rank(node, gen_dir, rank, command, env)
            if pid is None:
                pid = subprocess.Popen(
                    [sys.executable, "-m", "transom.controller.rankwrap", "--dir", str(gen_dir),
                     "--rank", str(rank), "--", *command],
                    env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True).pid
            pids.append(pid)
        handle = {"pids": pids, "port": port, "run_dir": str(gen_dir), "nodes": list(nodes),
                  "resume_step": resume_step}
        record.write(handle)
        warm = sum(1 for p in self._running if p.pid in pids)
        log.info("launched job %s generation %d on %s (resume from %s; %d of %d ranks in warm processes)", job,
                 generation, ",".join(nodes), "scratch" if resume_step is None else f"step {resume_step}", warm,
                 len(pids))
        if self.warm:
            self._warm_due = time.monotonic() + self.warm_delay
            self._warm_queue = [*nodes, *(n for n in self.agents if n not in nodes)]
        return handle

    # ------------------------------------------------------------------ warm ranks
    def _warm_process(self, node: str) -> subprocess.Popen:
        proc = self._warm.get(node)
        if proc is None or proc.poll() is not None:
            env = {**os.environ, **self.extra_env, "TRANSOM_NODE": node}
            with open(self.run_dir / f"warm-{node}.log", "ab") as err:
                proc = subprocess.Popen([sys.executable, "-m", "transom.controller.warmrank", "--preload", self.preload],
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                        start_new_session=True)
            os.set_blocking(proc.stdout.fileno(), False)
            proc.warm_ready = False
            self._warm[node] = proc
        return proc

    @staticmethod
    def _ready(proc: subprocess.Popen) -> bool:
        """Whether a warm process has finished its imports (it says so on its stdout)."""
        if not proc.warm_ready:
            try:
                proc.warm_ready = b"ready" in (os.read(proc.stdout.fileno(), 64) or b"")
            except BlockingIOError:
                pass
        return proc.warm_ready

    def prewarm(self, nodes: Sequence[str]) -> None:
        """Have a warm process ready on each of ``nodes`` (no-op without warm ranks)."""
        if self.warm:
            for node in nodes:
                if node in self.agents:
                    self._warm_process(node)

    def _start_warm_rank(self, node: str, gen_dir: Path, rank: int, command: Sequence[str],
                         env: Mapping[str, str]) -> int | None:
        argv = warm_argv(command) if self.warm else None
        proc = self._warm.pop(node, None)
        if argv is None or proc is None or proc.poll() is not None:
            if proc is not None and proc.poll() is None:
                self._warm[node] = proc       # not usable for this command: keep it for another
            return None
        request = {"dir": str(gen_dir), "rank": rank, "argv": argv, "env": dict(env), "cwd": os.getcwd()}
        try:
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.close()
        except (BrokenPipeError, OSError) as exc:
            log.warning("warm process of %s is gone (%s): rank %d starts cold", node, exc, rank)
            return None
        self._running.append(proc)
        return proc.pid

    def _replenish(self) -> None:
        """After a launch: warm the next node of the queue once no warm process is still importing."""
        self._running = [p for p in self._running if p.poll() is None]
        if self._warm_due is None or time.monotonic() < self._warm_due:
            return
        if any(p.poll() is None and not self._ready(p) for p in self._warm.values()):
            return
        schedulable = set(self.nodes())
        while self._warm_queue:
            node = self._warm_queue.pop(0)
            proc = self._warm.get(node)
            if node in schedulable and (proc is None or proc.poll() is not None):
                self._warm_process(node)
                return
        self._warm_due = None

    def status(self, job: str, generation: int) -> list[RankStatus]:
        record = LaunchRecord(self.run_dir, job, generation)
        gen_dir, handle = record.dir, record.read()
        if handle is None:
            return []
        self._replenish()
        self._reap()
        out = []
        for rank, pid in enumerate(handle["pids"]):
            exit_file = gen_dir / f"rank-{rank}.exit"
            if exit_file.exists():
                out.append(RankStatus(rank, False, int(exit_file.read_text().split()[0])))
            elif _alive(pid):
                out.append(RankStatus(rank, True, None))
            else:
                # the wrapper is gone without writing the exit code: killed from outside
                out.append(RankStatus(rank, False, -int(signal.SIGKILL)))
        return out

    def stop(self, job: str, generation: int, timeout: float = 10.0) -> None:
        record = LaunchRecord(self.run_dir, job, generation)
        gen_dir, handle = record.dir, record.read()
        pids = list(handle["pids"]) if handle else []
        pids += [p.pid for p in self._strays(gen_dir) if p.pid not in pids]
        live = [p for p in pids if _alive(p)]
        if not live:
            return
        for pid in live:
            # SIGCONT first: a hung (stopped) rank would otherwise never see SIGTERM
            _signal_group(pid, signal.SIGCONT)
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(_group_alive(p) for p in live):
            self._reap()
            time.sleep(0.1)
        for pid in live:
            if _group_alive(pid):
                log.warning("rank process group %d did not stop in %.0fs: killing it", pid, timeout)
                _signal_group(pid, signal.SIGKILL)
        self._reap()
        log.info("stopped job %s generation %d", job, generation)

    def health(self, nodes: Sequence[str]) -> dict[str, str]:
        cordoned = self._cordoned()
        out = {}
        for node in nodes:
            if node not in self.agents:
                out[node] = "no agent address (give --node NAME=HOST:PORT)"
            elif node in cordoned:
                out[node] = f"cordoned: {cordoned[node]}"
        return out

    def collective_test(self, job: str, generation: int, nodes: Sequence[str], timeout: float) -> dict[str, str]:
        """A gloo all-reduce across one process per node (``TRANSOM_NODE`` set); retried once on a new port.

        The processes are kept warm between tests (``collective --serve``, one per node, started
        at the first test for every node this backend knows), so a relaunch pays no torch import.
        """
        failed: dict[str, str] = {}
        for _attempt in range(2):
            failed = self._collective_warm(nodes, timeout)
            if failed is None:
                failed = self._collective_once(nodes, timeout)
            if len(failed) < len(nodes):
                return failed
            log.warning("collective test failed on every node (%s); retrying once on a new port",
                        next(iter(failed.values()), ""))
        return failed

    def _worker(self, node: str) -> subprocess.Popen:
        proc = self._workers.get(node)
        if proc is None or proc.poll() is not None:
            env = {**os.environ, **self.extra_env, "TRANSOM_NODE": node}
            proc = subprocess.Popen([sys.executable, "-m", "transom.controller.collective", "--serve"], env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    text=True, bufsize=1, start_new_session=True)
            self._workers[node] = proc
        return proc

    def _collective_warm(self, nodes: Sequence[str], timeout: float) -> dict[str, str] | None:
        """The test through the warm workers; None when they cannot be used (then a one-off run)."""
        import select

        for node in self.agents:          # start every node's worker at once: spares get warm too
            self._worker(node)
        self.prewarm(nodes)               # and the launch that follows a passed test starts warm
        workers = [self._worker(n) for n in nodes]
        master = f"127.0.0.1:{free_port()}"
        deadline = time.monotonic() + timeout + 30         # the first test waits for torch's import
        try:
            for rank, w in enumerate(workers):
                w.stdin.write(f"{rank} {len(nodes)} {master} {timeout}\n")
                w.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        answers: dict[int, str] = {}
        while len(answers) < len(workers) and time.monotonic() < deadline:
            pending = {w.stdout: r for r, w in enumerate(workers) if r not in answers}
            ready, _, _ = select.select(list(pending), [], [], 0.2)
            for f in ready:
                line = f.readline()
                if line.strip() == "ready":
                    continue
                answers[pending[f]] = line.strip() or "fail the worker exited"
        failed = {}
        for rank, node in enumerate(nodes):
            answer = answers.get(rank)
            if answer is None:
                failed[node] = "collective test did not answer in time"
                _signal_group(workers[rank].pid, signal.SIGKILL)
                self._workers.pop(node, None)
            elif answer != "ok":
                failed[node] = answer.removeprefix("fail ")
        return failed

    def close(self) -> None:
        """Stop the warm collective-test workers and the idle warm rank processes (not running ranks)."""
        for proc in [*self._workers.values(), *self._warm.values()]:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        self._workers.clear()
        self._warm.clear()

    def _collective_once(self, nodes: Sequence[str], timeout: float) -> dict[str, str]:
        master = f"127.0.0.1:{free_port()}"
        procs = []
        for rank, node in enumerate(nodes):
            env = {**os.environ, **self.extra_env, "TRANSOM_NODE": node}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "transom.controller.collective", "--rank", str(rank), "--world",
                 str(len(nodes)), "--master", master, "--timeout", str(timeout)],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                start_new_session=True))
        failed = {}
        deadline = time.monotonic() + timeout + 15     # torch's import on a loaded machine
        for node, proc in zip(nodes, procs):
            try:
                _, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.communicate()
                failed[node] = f"collective test did not finish in {timeout + 15:.0f}s"
                continue
            if proc.returncode != 0:
                lines = err.decode(errors="replace").strip().splitlines()
                failed[node] = f"collective test exited {proc.returncode}: {lines[-1] if lines else ''}"
        return failed

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _reap() -> None:
        try:
            while True:
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
        except ChildProcessError:
            pass

    @staticmethod
    def _strays(gen_dir: Path) -> list[psutil.Process]:
        marker = str(gen_dir)
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info.get("cmdline") or []
            if "transom.controller.rankwrap" in cmd and marker in cmd:
                found.append(proc)
        # warm processes that became ranks of this generation: their pid files name them
        for pidfile in gen_dir.glob("rank-*.pid") if gen_dir.is_dir() else ():
            try:
                proc = psutil.Process(int(pidfile.read_text().split()[0]))
                if "transom.controller.warmrank" in proc.cmdline() and proc.pid not in {p.pid for p in found}:
                    found.append(proc)
            except (OSError, ValueError, IndexError, psutil.Error):
                continue
        return found

    def _kill_strays(self, gen_dir: Path) -> None:
        for proc in self._strays(gen_dir):
            log.warning("killing rank wrapper %d left by an interrupted launch", proc.pid)
            _signal_group(proc.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # the group exists; it counts as alive unless all its members are zombies
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except (psutil.Error, ProcessLookupError):
            continue
    return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


register_backend("local", LocalBackend)
