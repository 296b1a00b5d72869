"""The two small processes of the test bed (transom/testbed.py), standard library only.

Run as a script by path (``python -I -S _bedproc.py MODE ...``) so that it needs neither the
project on ``sys.path`` nor the venv's site-packages:

``init SPEC_JSON``
    PID 1 of a bed host. Started by the bed as ``nsenter --net=NETNS unshare --mount --pid --uts
    --ipc --fork --kill-child``. It names the host, mounts a fresh /proc and /sys (cgroups kept),
    mounts a private tmpfs on each private directory (/tmp, /dev/shm), binds the shared paths that
    lie under them back in (the checkout, the venv, a test's shared directory), binds the bed's
    hosts file over /etc/hosts, prints one JSON line ``{"pid": ROOT_PID, "fds": {...}}`` and then
    reaps orphans until it is SIGKILLed, which kills every process of the host and frees its
    memory.

``enter INIT_PID:START_TIME PIDFD CWD -- ARGV...``
    Joins the namespaces of a host's init (net, uts, ipc, pid, mnt), forks ARGV inside the host,
    writes the child's PID (as the bed's own namespace sees it) on fd PIDFD, forwards signals to
    it and exits as it did (same exit code, or killed by the same signal). The child dies with
    this process (PR_SET_PDEATHSIG), so ``Popen.kill()`` of the bed's handle kills the real
    process too.
"""

import ctypes
import json
import os
import signal
import socket
import sys

_libc = ctypes.CDLL(None, use_errno=True)
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000
_MNT_DETACH = 2
_PR_SET_PDEATHSIG = 1
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
              signal.SIGUSR2, signal.SIGALRM, signal.SIGWINCH, signal.SIGCONT)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                       ctypes.c_ulong(flags), data and data.encode()), f"mount {fstype or 'bind'} {target}")


def _bind(source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            open(target, "a").close()
    _mount(source, target, None, _MS_BIND | _MS_REC)


def _root_pid() -> int:
    """This process's PID in the outermost PID namespace the current /proc shows."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return int(line.split()[1])
    return os.getpid()


def _drop_netns_mounts() -> None:
    """Unmount this mount namespace's copies of /run/netns/*: each would keep a network namespace of
    this or another bed alive after ``ip netns del`` until this host dies."""
    try:
        names = os.listdir("/run/netns")
    except OSError:
        return
    for name in names:
        _libc.umount2(f"/run/netns/{name}".encode(), _MNT_DETACH)
    _libc.umount2(b"/run/netns", _MNT_DETACH)


def init(spec: dict) -> None:
    out = sys.stdout
    try:                                  # any error, as one JSON line: the bed hides this stderr
        pid = _root_pid()                       # read before /proc is replaced by this host's own
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
        _drop_netns_mounts()
        _mount("proc", "/proc", "proc", 0)
        socket.sethostname(spec["hostname"])
        cgroup = os.open("/sys/fs/cgroup", os.O_PATH) if os.path.isdir("/sys/fs/cgroup") else None
        _mount("sysfs", "/sys", "sysfs", 0)      # this netns's devices under /sys/class/net
        if cgroup is not None:
            _mount(f"/proc/self/fd/{cgroup}", "/sys/fs/cgroup", None, _MS_BIND | _MS_REC)
            os.close(cgroup)
        fds = {}
        for private in spec["private"]:
            fd = os.open(private, os.O_PATH | os.O_DIRECTORY)
            fds[private] = fd
            _mount("tmpfs", private, "tmpfs", 0, "mode=1777")
            for path in spec["share"]:
                rel = os.path.relpath(path, private)
                if rel == "." or rel.startswith(".."):
                    continue
                if os.path.exists(path):          # already visible through a shared parent
                    continue
                _bind(f"/proc/self/fd/{fd}/{rel}", path)
        if spec.get("hosts_file"):
            _mount(spec["hosts_file"], "/etc/hosts", None, _MS_BIND)
        out.write(json.dumps({"pid": pid, "fds": fds}) + "\n")
        out.flush()
    except BaseException as exc:  # reported to the bed, which raises it with the host's name
        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        sys.exit(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    while True:                                   # PID 1: reap every orphan of the host
        signal.sigtimedwait([signal.SIGCHLD], 60)
        while True:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def enter(init: str, pidfd: int, cwd: str, argv: list) -> None:
    here = os.getcwd()
    init_pid, start = map(int, init.split(":"))
    try:
        fds = [os.open(f"/proc/{init_pid}/ns/{ns}", os.O_RDONLY) for ns in ("ipc", "uts", "net", "pid", "mnt")]
        if _start_time(init_pid) != start:        # the PID was reused: the host is gone
            raise FileNotFoundError
    except FileNotFoundError:
        sys.stderr.write(f"testbed: cannot run {argv[0]}: the host is gone (its init {init_pid} died)\n")
        sys.exit(137)
    for fd in fds:
        _check(_libc.setns(fd, 0), "setns")
        os.close(fd)
    try:
        os.chdir(cwd or here)
    except OSError:
        if cwd:
            sys.stderr.write(f"testbed: no directory {cwd} in the host\n")
            sys.exit(127)
        os.chdir("/")
    child = 0
    pending: list = []                     # signals that came before the child existed

    def forward(signum, _frame):
        if not child:
            pending.append(signum)
            return
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in _FORWARDED:                 # before the fork: no signal kills the relay alone
        signal.signal(sig, forward)
    child = os.fork()
    if child == 0:
        try:
            _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != 0:           # the relay (outside this PID namespace) already died
                os._exit(137)
            os.close(pidfd)
            for sig in _FORWARDED:
                signal.signal(sig, signal.SIG_DFL)
            os.execvp(argv[0], argv)
        except OSError as exc:
            sys.stderr.write(f"testbed: cannot run {argv[0]}: {exc.strerror}\n")
        os._exit(127)
    os.write(pidfd, f"{child}\n".encode())
    os.close(pidfd)
    for signum in pending:
        forward(signum, None)
    while True:
        _pid, status = os.waitpid(child, 0)
        if os.WIFEXITED(status):
            sys.exit(os.WEXITSTATUS(status))
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
            sys.exit(128 + sig)


def main(args: list) -> None:
    if args[0] == "init":
        init(json.loads(args[1]))
    elif args[0] == "enter":
        host_init, pidfd, cwd, sep, *argv = args[1:]
        assert sep == "--" and argv, "usage: enter INIT_PID:START_TIME PIDFD CWD -- ARGV..."
        enter(host_init, int(pidfd), cwd, argv)
    else:
        sys.exit(f"usage: {sys.argv[0]} init SPEC | enter INIT_PID:START_TIME PIDFD CWD -- ARGV...")


if __name__ == "__main__":
    main(sys.argv[1:])
