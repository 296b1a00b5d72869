"""The local backend: every rank a real process on this machine, "nodes" simulated by name.

Each rank runs under :mod:`transom.controller.rankwrap` in its own process group, so stopping a
rank stops everything it started, and its exit code lands in a file any controller can read.
Layout of ``run_dir``::

    run_dir/JOB/gen-G/launch.json      what was launched (written once the ranks are started)
    run_dir/JOB/gen-G/rank-R.{pid,log,exit}
    run_dir/cordoned.json              nodes kept out of launches, with the reason

Each launch gets a fresh rendezvous port (gloo cannot re-form a group on the old one).

Warm starts (``warm=True``, the default): the backend keeps one zygote (:mod:`.zygote`), a process
that imported torch once; a rank whose command is ``python -m MODULE`` or ``python SCRIPT.py``
(this interpreter, no interpreter flags) is a fork of it instead of a new interpreter under
rankwrap, with the same files (``rank-R.pid``, ``.log``, ``.exit``), and so is every process of the
pre-check's all-reduce. Any other command starts cold. ``run_dir/zygote.log`` has what the zygote
and the pre-check's processes said.
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
from .zygote import PRELOAD

__all__ = ["LocalBackend", "warm_argv"]

log = get("controller.local")


def warm_argv(command: Sequence[str], executable: str = sys.executable) -> list[str] | None:
    """The part of ``command`` after the interpreter when a fork of the zygote can run it, else None."""
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
                 preload: str = PRELOAD) -> None:
        self.run_dir = Path(run_dir).resolve()      # absolute: ranks run in the submitter's directory
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.agents = dict(agents)
        self.ckpt_dir = os.path.abspath(ckpt_dir) if ckpt_dir else None
        self.bootstrap = bootstrap
        self.extra_env = dict(env or {})
        self.warm, self.preload = warm, preload
        self._zygote: subprocess.Popen | None = None
        self._zy_next = 0                                  # request ids
        self._zy_buf = b""
        self._zy_answers: dict[int, list[dict]] = {}       # request id -> answers not yet taken

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

    def cordoned(self) -> dict[str, str]:
        return self._cordoned()

    def uncordon(self, node: str, reason: str) -> None:
        cordoned = self._cordoned()
        if cordoned.pop(node, None) is not None:
            write_atomic(str(self.run_dir / "cordoned.json"), json.dumps(cordoned, indent=1))
            log.info("uncordoned %s: %s", node, reason)

    def launch(self, job: str, generation: int, nodes: tuple[str, ...], command: tuple[str, ...],
               resume_step: int | None, *, workdir: str | None = None,
               env: Mapping[str, str] | None = None) -> Mapping[str, Any]:
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
        pids, forked = [], 0
        user_env = dict(env or {})
        if workdir and not os.path.isdir(workdir):
            raise ValueError(f"the job's working directory {workdir} does not exist on this host")
        for rank, node in enumerate(nodes):
            env = dict(os.environ)
            env.update(user_env)
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
            pid = self._fork_rank(gen_dir, rank, command, env, workdir)
            forked += pid is not None
            if pid is None:
                pid = subprocess.Popen(
                    [sys.executable, "-m", "transom.controller.rankwrap", "--dir", str(gen_dir),
                     "--rank", str(rank), "--", *command],
                    env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True, cwd=workdir or None).pid
            pids.append(pid)
        handle = {"pids": pids, "port": port, "run_dir": str(gen_dir), "nodes": list(nodes),
                  "resume_step": resume_step}
        record.write(handle)
        log.info("launched job %s generation %d on %s (resume from %s; %d of %d ranks forked from the zygote)", job,
                 generation, ",".join(nodes), "scratch" if resume_step is None else f"step {resume_step}", forked,
                 len(pids))
        return handle

    # ------------------------------------------------------------------ zygote
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
        import select

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
        rid = self._zy_send({"op": "rank", "dir": str(gen_dir), "rank": rank, "argv": argv, "env": dict(env),
                             "cwd": workdir or os.getcwd()})
        if rid is None:
            return None
        pid = self._zy_wait([rid], "pid", 120.0).get(rid, {}).get("pid")   # the first answer waits for the imports
        if pid is None:
            log.warning("the zygote did not fork rank %d within 120s: starting it cold", rank)
        return pid

    def status(self, job: str, generation: int) -> list[RankStatus]:
        record = LaunchRecord(self.run_dir, job, generation)
        gen_dir, handle = record.dir, record.read()
        if handle is None:
            return []
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

        The processes are forks of the zygote (no torch import), else fresh interpreters.
        """
        failed: dict[str, str] = {}
        for _attempt in range(2):
            failed = self._collective_forked(nodes, timeout)
            if failed is None:
                failed = self._collective_once(nodes, timeout)
            if len(failed) < len(nodes):
                return failed
            log.warning("collective test failed on every node (%s); retrying once on a new port",
                        next(iter(failed.values()), ""))
        return failed

    def _collective_forked(self, nodes: Sequence[str], timeout: float) -> dict[str, str] | None:
        """The test in processes forked from the zygote; None when it cannot fork them (then fresh ones)."""
        master = f"127.0.0.1:{free_port()}"
        ids = []
        for rank, node in enumerate(nodes):
            rid = self._zy_send({"op": "collective", "rank": rank, "world": len(nodes), "master": master,
                                 "timeout": timeout, "node": node})
            if rid is None:
                return None
            ids.append(rid)
        pids = self._zy_wait(ids, "pid", 120.0)                     # the first request waits for the imports
        if len(pids) < len(ids):
            return None
        results = self._zy_wait(ids, "code", timeout + 10.0)
        failed = {}
        for rid, node in zip(ids, nodes):
            res = results.get(rid)
            if res is None:
                failed[node] = "collective test did not answer in time"
                _signal_group(pids[rid]["pid"], signal.SIGKILL)
            elif res["code"] != 0:
                failed[node] = res.get("why") or f"collective test exited {res['code']}"
        return failed

    def close(self) -> None:
        """Stop the zygote (the ranks it forked live on, in their own sessions)."""
        if self._zygote is not None and self._zygote.poll() is None:
            _signal_group(self._zygote.pid, signal.SIGKILL)
            self._zygote.wait()
        self._zygote = None

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
        # ranks forked from the zygote: their pid files name them
        for pidfile in gen_dir.glob("rank-*.pid") if gen_dir.is_dir() else ():
            try:
                proc = psutil.Process(int(pidfile.read_text().split()[0]))
                if "transom.controller.zygote" in proc.cmdline() and proc.pid not in {p.pid for p in found}:
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
