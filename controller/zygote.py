"""The local backend's zygote: one process that imported torch once and forks every rank and test.

Starting a rank costs an interpreter's start and torch's import before the first line of the job
runs (about 3 s each here; 6 s for four ranks on two cores, 12 s to their first step), and a
relaunch pays it on the critical path; so does each process of the pre-check's all-reduce. The
local backend (all its "nodes" are this machine) keeps one zygote instead:
``python -m transom.controller.zygote --preload torch`` imports the listed modules, then reads
requests from its stdin, one JSON line each, and answers on its stdout, one JSON line each:

``{"id": I, "op": "rank", "dir": GEN_DIR, "rank": R, "argv": [...], "env": {...}, "cwd": D}``
    fork a child that becomes the rank (:func:`become_rank`): it takes ``env`` and ``cwd``, sends
    its stdout and stderr to ``GEN_DIR/rank-R.log``, writes ``GEN_DIR/rank-R.pid`` (``pid pid``:
    it is the rank and the leader of its own session), runs ``argv`` (``["-m", MODULE, ...]`` or
    ``[SCRIPT.py, ...]``) as ``__main__`` with runpy, as ``python -m`` / ``python SCRIPT.py``
    would, writes the exit code to ``GEN_DIR/rank-R.exit`` atomically and exits with it. Answer:
    ``{"id": I, "pid": P}``.
``{"id": I, "op": "collective", "rank": R, "world": N, "master": "HOST:PORT", "timeout": S}``
    fork a child that runs the pre-check's all-reduce (:func:`.collective.run_once`). Answers:
    ``{"id": I, "pid": P}`` at once, ``{"id": I, "code": C, "why": "..."}`` when it is done.

Forking costs milliseconds and the children share the imported modules copy-on-write, so nothing
is imported again and no process has to be kept warm per node. The zygote itself never runs torch
(so no thread pool exists when it forks) and reaps its children: a rank killed by a signal gets its
exit file from the zygote (``-SIGNUM``, as rankwrap records it). When its stdin closes (the
controller went away) it stops taking requests and exits once the ranks it forked have ended (they
live on, in their own process groups, for the next controller to adopt).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import sys
import time
import traceback
from typing import Any

from .rankwrap import write_atomic

__all__ = ["main", "become_rank", "PRELOAD"]

#: What the zygote imports before it forks anything (comma-separated modules). ``torch._dynamo``: every
#: torch optimizer's constructor imports it (1.1-1.4 s of CPU here, more than the rest of a rank's start-up),
#: so each fork would pay it again, on the critical path of a relaunch and in every warm spare's start.
PRELOAD = "torch,torch.distributed,torch.nn,torch._dynamo"


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)          # sys.exit("message"): printed, status 1, as the interpreter does
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (ValueError, OSError):      # the job closed or broke it
            pass


def _detach(log_path: str | None) -> None:
    """In a fresh child: own session (or at least own process group: the zygote makes the child a
    group leader right after the fork, so that stopping it works before this line has run), stdin
    from /dev/null, stdout and stderr to ``log_path``."""
    with contextlib.suppress(OSError):    # already a group leader (the zygote was first): keep that group
        os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if log_path:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)


def become_rank(req: dict[str, Any]) -> int:
    """Run the rank of ``req`` in this (forked) process; its exit code, also written to ``rank-R.exit``."""
    base = os.path.join(req["dir"], f"rank-{int(req['rank'])}")
    _detach(f"{base}.log")
    os.chdir(req.get("cwd") or os.getcwd())
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in req["env"].items()})
    sys.stdin = open(os.devnull)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    write_atomic(f"{base}.pid", f"{os.getpid()} {os.getpid()}\n")
    argv = list(req["argv"])
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = [argv[0], *argv[1:]]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:                 # what the interpreter would print for an uncaught exception
        traceback.print_exc()
        code = 1
    _flush()
    write_atomic(f"{base}.exit", f"{code}\n")
    return code


def _collective(req: dict[str, Any]) -> None:
    from .collective import run_once

    out = os.dup(1)                       # the answer goes to the zygote's stdout (a line is atomic)
    _detach(None)
    try:
        code, why = run_once(int(req["rank"]), int(req["world"]), str(req["master"]), float(req["timeout"]))
    except BaseException as exc:          # noqa: BLE001 - whatever it is, the controller must hear of it
        code, why = 2, f"collective test rank {req.get('rank')}: {type(exc).__name__}: {exc}"
    os.write(out, (json.dumps({"id": req.get("id"), "code": code, "why": why[:2000]}) + "\n").encode())
    os._exit(0)


def _reap(children: dict[int, str | None]) -> None:
    """Reap ended children; a rank that died from a signal gets its exit file here (``-SIGNUM``, as
    rankwrap writes it), since it could not write one itself."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exit_path = children.pop(pid, None)
        if exit_path and not os.path.exists(exit_path):
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.waitstatus_to_exitcode(status)
            try:
                write_atomic(exit_path, f"{code}\n")
            except OSError:
                pass


def _answer(msg: dict[str, Any]) -> None:
    os.write(1, (json.dumps(msg) + "\n").encode())


def serve() -> int:
    """Answer requests until stdin closes; in a forked rank, return its exit code (see :func:`main`)."""
    pending = b""
    children: dict[int, str | None] = {}  # pid -> the exit file of a rank (None: a pre-check process)
    # reap (and record) a child the moment it ends, not at the next turn of the loop
    signal.signal(signal.SIGCHLD, lambda *_: _reap(children))
    while True:
        _reap(children)
        if not select.select([0], [], [], 0.5)[0]:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:                     # the controller went away: record how its ranks end, then go
            while children:
                time.sleep(0.5)
                _reap(children)
            return 0
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if not line.strip():
                continue
            try:
                req = json.loads(line)
                op = req["op"]
                if op not in ("rank", "collective"):
                    raise ValueError(f"unknown op {op!r}")
            except (ValueError, KeyError, TypeError) as exc:
                _answer({"id": None, "error": f"bad request {line[:200]!r}: {exc}"})
                continue
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})     # record the child before reaping it
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
                if op == "collective":
                    _collective(req)      # never returns
                return become_rank(req)   # unwinds to the interpreter's exit: atexit handlers run
            children[pid] = os.path.join(req["dir"], f"rank-{int(req['rank'])}.exit") if op == "rank" else None
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            # its own group before anyone learns its pid (stop() signals the group); an OSError means the
            # child's setsid() came first and it leads its own group already
            with contextlib.suppress(OSError):
                os.setpgid(pid, pid)
            _answer({"id": req.get("id"), "pid": pid})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m transom.controller.zygote",
                                description="import modules once, then fork training ranks and pre-check tests on "
                                            "request (the local backend's zygote; JSON lines on stdin and stdout)")
    p.add_argument("--preload", default=PRELOAD,
                   help=f"comma-separated modules to import first (default {PRELOAD}; one that fails to import "
                        "is skipped)")
    args = p.parse_args(argv)
    for name in filter(None, (m.strip() for m in args.preload.split(","))):
        try:
            importlib.import_module(name)
        except Exception as exc:          # the rank will import it itself, and say what is wrong
            print(f"zygote: could not preload {name}: {exc}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    return serve()


if __name__ == "__main__":
    sys.exit(main())
