"""A warm Python process that becomes one training rank: torch is imported before the job needs it.

Starting a rank costs the interpreter's start and the import of torch before the first line of the
job runs (about 3 s each here, 6 s for four ranks on two cores), and a relaunch pays it on the
critical path. The local backend keeps one warm process per node: ``python -m
transom.controller.warmrank --preload torch`` imports the listed modules, says ``ready`` on its stdout
and waits on its stdin for one launch request, a JSON line::

    {"dir": GEN_DIR, "rank": R, "argv": ["-m", "pkg.mod", ...] | ["script.py", ...],
     "env": {...}, "cwd": "/path"}

Then it does what :mod:`.rankwrap` does for a fresh process: takes the request's environment and
working directory, sends its stdout and stderr to ``GEN_DIR/rank-R.log``, writes
``GEN_DIR/rank-R.pid`` (``pid pid``: this process is the rank, and the leader of its process
group), runs the module or script as ``__main__`` (``runpy``, as ``python -m`` / ``python
script.py`` would) and writes the exit code to ``GEN_DIR/rank-R.exit`` atomically. An idle warm
process exits when its stdin closes (the controller went away); a running rank does not read it.

Only commands ``sys.executable -m MODULE ...`` and ``sys.executable SCRIPT.py ...`` can run warm
(``transom.controller.local.warm_argv``); anything else (interpreter flags, another program) runs under rankwrap.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import sys
import traceback
from .rankwrap import write_atomic

__all__ = ["main"]


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)          # sys.exit("message"): printed, status 1, as the interpreter does
    return 1


def _become_rank(req: dict) -> int:
    base = os.path.join(req["dir"], f"rank-{int(req['rank'])}")
    os.chdir(req.get("cwd") or os.getcwd())
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in req["env"].items()})
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(f"{base}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    sys.stdout.reconfigure(line_buffering=True, write_through=True)
    sys.stderr.reconfigure(line_buffering=True, write_through=True)
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


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (ValueError, OSError):      # the job closed or broke it
            pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m transom.controller.warmrank",
                                description="import modules now, then run one training rank sent as a JSON line "
                                            "on stdin (the local backend's warm processes)")
    p.add_argument("--preload", default="torch", help="comma-separated modules to import while waiting "
                                                      "(default torch; one that fails to import is skipped)")
    args = p.parse_args(argv)
    for name in filter(None, (m.strip() for m in args.preload.split(","))):
        try:
            importlib.import_module(name)
        except Exception as exc:          # the rank will import it itself, and say what is wrong
            print(f"warmrank: could not preload {name}: {exc}", file=sys.stderr, flush=True)
    print("ready", flush=True)            # to the backend, which warms one process at a time
    line = sys.stdin.readline()
    if not line.strip():
        return 0                          # the controller went away before using this process
    return _become_rank(json.loads(line))


if __name__ == "__main__":
    sys.exit(main())
