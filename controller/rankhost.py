"""Ranks on this host: start them (forks of one zygote, else under rankwrap), watch, stop, pre-check.

Shared by the local backend (every "node" on the controller's machine) and the node launcher
(:mod:`.launcher`, one per node host, at the controller's request). A :class:`RankHost` knows
nothing of jobs or nodes beyond the directories and environments it is given. Layout of a
generation's directory::

    GEN_DIR/rank-R.pid    "WRAPPER_PID RANK_PID" (the wrapper leads the rank's process group)
    GEN_DIR/rank-R.log    the rank's stdout and stderr
    GEN_DIR/rank-R.exit   its exit code, written atomically when it ends (negative: the signal)

Warm starts (``warm=True``): one zygote (:mod:`.zygote`), a process that imported torch once; a
rank whose command is ``python -m MODULE`` or ``python SCRIPT.py`` (this interpreter, found on
``PATH`` when named without a directory; no interpreter flags) is a fork of it, and so is every
process of the pre-check's all-reduce. Any other command starts cold, under rankwrap.
``RUN_DIR/zygote.log`` has what the zygote and the pre-check's processes said.

Thread safety: the zygote's pipe is used under one lock, so a launcher may serve requests from
several threads.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import psutil

from transom.log import get

from .backend import RankStatus
from .zygote import PRELOAD

__all__ = ["RankHost", "warm_argv", "signal_group", "alive"]

log = get("controller.rankhost")


def warm_argv(command: Sequence[str], executable: str = sys.executable) -> list[str] | None:
    """The part of ``command`` after the interpreter when a fork of the zygote can run it, else None.

    ``command[0]`` names this interpreter when it is the same file, or a name for it in the same
    directory (``python`` and ``python3`` of one virtual environment); a bare name is looked up on
    ``PATH``, as the kernel would.
    """
    if len(command) < 2:
        return None
    found = shutil.which(command[0]) if os.sep not in command[0] else command[0]
    if not found:
        return None
    mine, theirs = os.path.abspath(executable), os.path.abspath(found)
    same = theirs == mine or (os.path.dirname(theirs) == os.path.dirname(mine)
                              and os.path.realpath(theirs) == os.path.realpath(mine))
    if not same:
        return None
    if command[1] == "-m" and len(command) >= 3 and not command[2].startswith("-"):
        return list(command[1:])
    if command[1].endswith(".py") and not command[1].startswith("-"):
        return list(command[1:])
    return None


class RankHost:
    """Starts and watches ranks on this host; ``env`` is added to every rank's and the zygote's environment."""

    def __init__(self, run_dir: str | os.PathLike, *, env: Mapping[str, str] | None = None, warm: bool = True,
                 preload: str = PRELOAD) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.extra_env = dict(env or {})
        self.warm, self.preload = warm, preload
        self._lock = threading.RLock()
        self._zygote: subprocess.Popen | None = None
        self._zy_next = 0                                  # request ids
        self._zy_buf = b""
        self._zy_answers: dict[int, list[dict]] = {}       # request id -> answers not yet taken

    # ------------------------------------------------------------------ ranks
    def start(self, gen_dir: Path, ranks: Sequence[tuple[int, Mapping[str, str]]], command: Sequence[str],
              workdir: str | None = None) -> tuple[dict[int, int], int]:
        """Start ``command`` once per ``(rank, env)`` (``env`` complete) in ``workdir`` (None: this process's);
        rank -> pid, and how many were forked."""
        gen_dir.mkdir(parents=True, exist_ok=True)
        self.kill_strays(gen_dir)          # a launch interrupted before its record was written
        pids, forked = {}, 0
        for rank, env in ranks:
            pid = self._fork_rank(gen_dir, rank, command, env, workdir)
            forked += pid is not None
            if pid is None:
                pid = subprocess.Popen(
                    [sys.executable, "-m", "transom.controller.rankwrap", "--dir", str(gen_dir),
                     "--rank", str(rank), "--", *command],
                    env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True, cwd=workdir or None).pid
            pids[rank] = pid
        return pids, forked

    def status(self, gen_dir: Path, pids: Mapping[int, int]) -> list[RankStatus]:
        """The state of each rank in ``pids`` (rank -> pid), from its exit file or its process."""
        self.reap()
        out = []
        for rank, pid in sorted(pids.items()):
            exit_file = gen_dir / f"rank-{rank}.exit"
            if exit_file.exists():
                out.append(RankStatus(rank, False, int(exit_file.read_text().split()[0])))
            elif alive(pid):
                out.append(RankStatus(rank, True, None))
            else:
                # the wrapper is gone without writing the exit code: killed from outside
                out.append(RankStatus(rank, False, -int(signal.SIGKILL)))
        return out

    def stop(self, gen_dir: Path, pids: Iterable[int], timeout: float = 10.0) -> bool:
        """Stop the process groups of ``pids`` and any stray of ``gen_dir``; False if none was running."""
        pids = list(pids)
        pids += [p.pid for p in self.strays(gen_dir, spares=True) if p.pid not in pids]
        live = [p for p in pids if alive(p)]
        if not live:
            return False
        for pid in live:
            # SIGCONT first: a hung (stopped) rank would otherwise never see SIGTERM
            signal_group(pid, signal.SIGCONT)
            signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(_group_alive(p) for p in live):
            self.reap()
            time.sleep(0.1)
        for pid in live:
            if _group_alive(pid):
                log.warning("rank process group %d did not stop in %.0fs: killing it", pid, timeout)
                signal_group(pid, signal.SIGKILL)
        self.reap()
        return True

    def log_tail(self, gen_dir: Path, rank: int, nbytes: int = 4096) -> str:
        path = gen_dir / f"rank-{int(rank)}.log"
        if not path.exists():
            return ""
        with open(path, "rb") as f:
            f.seek(max(path.stat().st_size - nbytes, 0))
            return f.read().decode(errors="replace")

    # ------------------------------------------------------------------ pre-check
    def collective(self, ranks: Sequence[tuple[int, str]], world: int, master: str,
                   timeout: float) -> dict[str, str]:
        """This host's part of a gloo all-reduce of ``world`` processes at ``master``: one process per
        ``(rank, node)``; node -> reason for those that failed. Forks of the zygote, else fresh interpreters."""
        failed = self._collective_forked(ranks, world, master, timeout)
        if failed is None:
            failed = self._collective_cold(ranks, world, master, timeout)
        return failed

    def _collective_forked(self, ranks: Sequence[tuple[int, str]], world: int, master: str,
                           timeout: float) -> dict[str, str] | None:
        with self._lock:
            ids = []
            for rank, node in ranks:
                rid = self._zy_send({"op": "collective", "rank": rank, "world": world, "master": master,
                                     "timeout": timeout, "node": node})
                if rid is None:
                    return None
                ids.append(rid)
            pids = self._zy_wait(ids, "pid", 120.0)                     # the first request waits for the imports
            if len(pids) < len(ids):
                return None
            results = self._zy_wait(ids, "code", timeout + 10.0)
        failed = {}
        for rid, (_rank, node) in zip(ids, ranks):
            res = results.get(rid)
            if res is None:
                failed[node] = "collective test did not answer in time"
                signal_group(pids[rid]["pid"], signal.SIGKILL)
            elif res["code"] != 0:
                failed[node] = res.get("why") or f"collective test exited {res['code']}"
        return failed

    def _collective_cold(self, ranks: Sequence[tuple[int, str]], world: int, master: str,
                         timeout: float) -> dict[str, str]:
        procs = []
        for rank, node in ranks:
            env = {**os.environ, **self.extra_env, "TRANSOM_NODE": node}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "transom.controller.collective", "--rank", str(rank), "--world",
                 str(world), "--master", master, "--timeout", str(timeout)],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                start_new_session=True))
        failed = {}
        deadline = time.monotonic() + timeout + 15     # torch's import on a loaded machine
        for (_rank, node), proc in zip(ranks, procs):
            try:
                _, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)
                proc.communicate()
                failed[node] = f"collective test did not finish in {timeout + 15:.0f}s"
                continue
            if proc.returncode != 0:
                lines = err.decode(errors="replace").strip().splitlines()
                failed[node] = f"collective test exited {proc.returncode}: {lines[-1] if lines else ''}"
        return failed

    # ------------------------------------------------------------------ zygote
    def warm_up(self) -> None:
        """Start the zygote now (it imports torch in the background), so that the first launch is warm."""
        with self._lock:
            self._zy()

    def _zy(self) -> subprocess.Popen | None:
        """The zygote, started on first use (None when warm starts are off)."""
        if not self.warm:
            return None
        if self._zygote is None or self._zygote.poll() is not None:
            env = {**os.environ, **self.extra_env}
            with open(self.run_dir / "zygote.log", "ab") as err:
                self._zygote = subprocess.Popen(
                    [sys.executable, "-m", "transom.controller.zygote", "--preload", self.preload], env=env,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, start_new_session=True)
            self._zy_buf, self._zy_answers = b"", {}
        return self._zygote

    def _zy_send(self, req: dict[str, Any]) -> int | None:
        """Send a request; its id, or None when the zygote cannot take it."""
        zy = self._zy()
        if zy is None:
            return None
        self._zy_next += 1
        req = {**req, "id": self._zy_next}
        try:
            zy.stdin.write((json.dumps(req) + "\n").encode())
            zy.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            log.warning("the zygote is gone (%s): starting cold", exc)
            return None
        return req["id"]

    def _zy_wait(self, ids: Sequence[int], key: str, timeout: float) -> dict[int, dict]:
        """The first answer with ``key`` for each of ``ids`` that comes within ``timeout`` seconds."""
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        while True:
            for i in ids:
                msg = None if i in got else self._zy_take(i, key)
                if msg is not None:
                    got[i] = msg
            left = deadline - time.monotonic()
            if len(got) == len(ids) or left <= 0 or not self._zy_read(min(left, 0.5)):
                return got

    def _zy_take(self, rid: int, key: str) -> dict | None:
        """The first answer to request ``rid`` that has ``key``, taken out of those read so far."""
        answers = self._zy_answers.get(rid, [])
        k = next((k for k, msg in enumerate(answers) if key in msg), None)
        return None if k is None else answers.pop(k)

    def _zy_read(self, timeout: float) -> bool:
        """Read what the zygote answered within ``timeout`` s into ``_zy_answers``; False once it is gone."""
        if self._zygote is None:
            return False
        fd = self._zygote.stdout.fileno()
        if not select.select([fd], [], [], timeout)[0]:
            return self._zygote.poll() is None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return False
        self._zy_buf += chunk
        while b"\n" in self._zy_buf:
            line, self._zy_buf = self._zy_buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("error"):
                log.warning("zygote: %s", msg["error"])
            self._zy_answers.setdefault(msg.get("id"), []).append(msg)
        return True

    def _fork_rank(self, gen_dir: Path, rank: int, command: Sequence[str], env: Mapping[str, str],
                   workdir: str | None = None) -> int | None:
        """The pid of the rank forked from the zygote, or None to start it cold."""
        argv = warm_argv(command) if self.warm else None
        if argv is None:
            return None
        with self._lock:
            rid = self._zy_send({"op": "rank", "dir": str(gen_dir), "rank": rank, "argv": argv, "env": dict(env),
                                 "cwd": workdir or os.getcwd()})
            if rid is None:
                return None
            pid = self._zy_wait([rid], "pid", 120.0).get(rid, {}).get("pid")   # the first answer waits for imports
        if pid is None:
            log.warning("the zygote did not fork rank %d within 120s: starting it cold", rank)
        return pid

    def close(self) -> None:
        """Stop the zygote (the ranks it forked live on, in their own sessions)."""
        with self._lock:
            if self._zygote is not None and self._zygote.poll() is None:
                signal_group(self._zygote.pid, signal.SIGKILL)
                self._zygote.wait()
            self._zygote = None

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def reap() -> None:
        try:
            while True:
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
        except ChildProcessError:
            pass

    @staticmethod
    def strays(gen_dir: Path, *, spares: bool = False) -> list[psutil.Process]:
        """Rank processes of ``gen_dir`` found by their command line or pid files (after a lost record); with
        ``spares``, its warm spares' too (``spare-*/``: one whose controller died before writing its record)."""
        dirs = {str(gen_dir)}
        if spares and gen_dir.is_dir():
            dirs |= {str(d) for d in gen_dir.glob("spare-*") if d.is_dir()}
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info.get("cmdline") or []
            if "transom.controller.rankwrap" in cmd and dirs & set(cmd):
                found.append(proc)
        # ranks forked from the zygote: their pid files name them
        pidfiles = [*gen_dir.glob("rank-*.pid"), *(gen_dir.glob("spare-*/rank-*.pid") if spares else ())] \
            if gen_dir.is_dir() else []
        for pidfile in pidfiles:
            try:
                proc = psutil.Process(int(pidfile.read_text().split()[0]))
                if "transom.controller.zygote" in proc.cmdline() and proc.pid not in {p.pid for p in found}:
                    found.append(proc)
            except (OSError, ValueError, IndexError, psutil.Error):
                continue
        return found

    def kill_strays(self, gen_dir: Path) -> None:
        for proc in self.strays(gen_dir):
            log.warning("killing rank wrapper %d left by an interrupted launch", proc.pid)
            signal_group(proc.pid, signal.SIGKILL)


def alive(pid: int) -> bool:
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


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
