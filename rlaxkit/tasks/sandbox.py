"""Run an untrusted Python program in a child process with hard limits and, on Linux,
in namespaces of its own.

Each run gets a fresh working directory, an environment with nothing inherited (no tokens
or keys from the parent), and these limits:

* wall-clock time (the whole process group is killed at the deadline);
* CPU time (``RLIMIT_CPU``: ``SIGXCPU`` at the limit, ``SIGKILL`` a second later);
* address space (``RLIMIT_AS``: allocations beyond it raise ``MemoryError``);
* processes and threads (``RLIMIT_NPROC``) plus an audit hook that refuses ``fork``,
  ``exec``, ``system``, ``posix_spawn``, ``subprocess``, ``kill`` and ``ctypes`` loading.
  The hook matters for a program running as root, whose ``RLIMIT_NPROC`` the kernel
  ignores: in limits-only mode under a root caller;
* output: stdout and stderr are read incrementally and the program is killed once they
  exceed ``max_output_bytes``, so a gigabyte of output never lands in memory; files it
  writes are capped by ``RLIMIT_FSIZE``;
* lifetime: on Linux the child is SIGKILLed when the process that started it dies
  (``PR_SET_PDEATHSIG``, and with namespaces the death of the PID namespace's init), so
  a reward worker killed for a timeout leaks no program.

The limits are set by a small launcher inside the child (``resource.setrlimit``), not by
a ``preexec_fn``, which is unsafe in a threaded parent (and JAX starts threads).

**Isolation** (``isolation_mode()``). Where the kernel allows it, the launcher puts the
program in new user, mount, PID, network, IPC and UTS namespaces (``unshare(2)`` through
``ctypes``, no external binary) before it runs:

* it runs as root of its own user namespace, mapped to ``nobody`` (65534) outside when the
  caller is root (else to the caller's uid), with every capability dropped and
  ``no_new_privs`` set; being non-root outside also makes the kernel enforce
  ``RLIMIT_NPROC``, which caps threads as well as processes;
* its root is a fresh tmpfs holding only read-only binds of the Python installation
  (``sys.base_prefix``, ``sys.prefix``), the shared-library directories, ``/dev/null``,
  ``/dev/zero``, ``/dev/random`` and ``/dev/urandom``, and the ``/proc`` of its own PID
  namespace: no ``/etc``, no home directory, no run directory, no other program's files,
  no ``/dev/shm``;
* ``/tmp`` is a private tmpfs of ``max_disk_bytes`` (no exec), holding its working
  directory; all it writes is lost when it ends;
* the installation is bound at its own path wherever it lives: one under ``/tmp`` or
  ``/dev`` (a venv in ``/tmp``) is bound read-only inside the private ``/tmp`` or ``/dev``
  after they are made, so that no path of the view collides with the sandbox's own mount
  points and the rest of the host's ``/tmp`` stays out of sight;
* its network namespace has only a loopback interface, left down: no route anywhere (not
  even to itself), no name resolution;
* it is PID 2 of its own PID namespace under a small init: it can see and signal no process
  outside, and everything it leaves behind dies with the init;
* its System V IPC objects, host name (``sandbox``) and session keyring are its own.

Setting up costs about 10 ms of CPU per program, next to about 40 ms for starting the
interpreter (``benchmarks/rewards.py`` measures code rewards per second both ways).
Where the kernel refuses namespaces (no unprivileged user namespaces, a seccomp policy,
not Linux) the sandbox falls back to the limits alone and logs a warning once per process;
``isolation_mode()`` says which is in use, for the run summary.

Not contained, even with namespaces: the program shares the kernel (a kernel exploit
escapes), CPU caches and timing side channels; it reads the kernel's global ``/proc``
files (``cpuinfo``, ``meminfo``, its own mount table, which names the bound paths); its
tmpfs takes up to ``max_disk_bytes`` of memory on top of ``RLIMIT_AS``. The audit hook
is not a boundary: ``_posixsubprocess.fork_exec`` and ``signal.pidfd_send_signal`` raise
no audit event, and an extension module written to a ``memfd`` loads native code that
makes system calls directly (the tmpfs mounts are ``noexec``, memory files are not);
with namespaces that gains nothing, but in limits-only mode a program can also read
whatever the user can read, use the network, signal the user's processes and, under a
root caller, fork without limit. Run adversarial code there behind an OS-level boundary
(a container, gVisor, a VM).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from rlaxkit.tasks.base import (
    CPU_TIME_LIMIT,
    FORBIDDEN_OPERATION,
    MEMORY_LIMIT,
    OUTPUT_LIMIT,
    RUNTIME_ERROR,
)

SandboxStatus = Literal[
    "ok",
    "runtime_error",
    "wall_timeout",
    "cpu_time_limit",
    "memory_limit",
    "output_limit",
    "forbidden_operation",
]
IsolationMode = Literal["namespaces", "limits-only"]
Isolation = Literal["auto", "namespaces", "limits-only"]
ISOLATIONS: tuple[Isolation, ...] = ("auto", "namespaces", "limits-only")
MEMORY_EXIT_CODE = 97  # the launcher's exit status after an uncaught MemoryError
FORBIDDEN_EXIT_CODE = 98  # ... after an uncaught refusal by the audit hook
SETUP_EXIT_CODE = 99  # ... when it could not build the namespaces (the reason is on a pipe)
UNPRIVILEGED_ID = 65534  # ``nobody``: the uid and gid a root caller's programs run as
_READ_CHUNK_BYTES = 65536
_LIBRARY_DIRS = ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32")
_SANDBOX_MOUNTS = ("/dev", "/proc", "/tmp")  # made by the sandbox; the view goes below
_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
# System calls glibc does not wrap, by machine: (pivot_root, keyctl).
_SYSCALLS = {"x86_64": (155, 250), "aarch64": (41, 219), "riscv64": (41, 219)}
_LOGGER = logging.getLogger(__name__)

# The launcher runs as ``python -I -B -c _LAUNCHER CONFIG_JSON``. With namespaces the
# process tree is: launcher (outside, relays the exit status) -> init (PID 1, builds the
# root, then waits) -> program (PID 2). Numbers are Linux's <sched.h>, <sys/mount.h> and
# <linux/prctl.h> constants.
_LAUNCHER = r"""
import ctypes, errno, json, os, resource, runpy, signal, sys
config = json.loads(sys.argv[1])
limits = config["limits"]
libc = ctypes.CDLL(None, use_errno=True)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

def die_with_parent(parent_pid):
    if sys.platform.startswith("linux"):
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (cleared by a change of uid)
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the line above took effect

def check(result, what):
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")

def mount(source, target, fstype, flags, data=None):
    encode = lambda text: None if text is None else text.encode()
    result = libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags),
                        encode(data))
    check(result, f"mount {source} on {target}")

def write(path, text):
    with open(path, "w") as file:
        file.write(text)

RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
LOCKED_FLAGS = ((os.ST_NOEXEC, NOEXEC), (os.ST_NOATIME, 1024), (os.ST_NODIRATIME, 2048),
                (os.ST_RELATIME, 1 << 21))

def bind_read_only(target):
    # A remount must repeat the flags the kernel locked on the source mount.
    flags = BIND | REMOUNT | RDONLY | NOSUID | NODEV
    f_flag = os.statvfs(target).f_flag
    flags |= sum(mount_flag for st_flag, mount_flag in LOCKED_FLAGS if f_flag & st_flag)
    mount(None, target, None, flags)

def build_root(source):
    # Runs as PID 1 of the new namespaces, with all capabilities over them.
    root, cwd = config["root"], config["cwd"]
    mount(None, "/", None, REC | PRIVATE)  # nothing below propagates to the host
    mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "mode=755,size=1m")
    # The sandbox's own mount points first, then the view, which may lie below them (a
    # venv under /tmp or /dev/shm is bound into the private scratch, read-only).
    os.mkdir(root + "/dev")
    for device in config["devices"]:
        open(root + device, "w").close()
        mount(device, root + device, None, BIND)
    os.mkdir(root + "/proc")
    mount("proc", root + "/proc", "proc", NOSUID | NODEV | NOEXEC)
    os.mkdir(root + "/tmp")
    scratch = f"mode=1777,size={limits['max_disk_bytes']}"
    mount("tmpfs", root + "/tmp", "tmpfs", NOSUID | NODEV | NOEXEC, scratch)
    for path, kind, link in config["view"]:
        target = root + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if kind == "symlink":
            os.symlink(link, target)
            continue
        os.makedirs(target, exist_ok=True)
        mount(path, target, None, BIND | REC)
        bind_read_only(target)
    os.mkdir(root + cwd)
    with open(root + cwd + "/solution.py", "wb") as file:
        file.write(source)
    os.chdir(root)
    check(libc.syscall(PIVOT_ROOT, b".", b"."), "pivot_root")
    check(libc.umount2(b".", 2), "detach the old root")  # MNT_DETACH
    os.chdir("/")
    mount(None, "/", None, BIND | REMOUNT | RDONLY | NOSUID | NODEV)
    check(libc.sethostname(b"sandbox", 7), "sethostname")
    # KEYCTL_JOIN_SESSION_KEYRING, anonymous: the caller's session keys are not possessed.
    if libc.syscall(KEYCTL, 1, None) < 0 and ctypes.get_errno() != errno.ENOSYS:
        check(-1, "join a new session keyring")
    if not config["in_user_namespace"]:
        # Root of the machine: become nobody, in a user namespace of its own (so that
        # RLIMIT_NPROC counts this sandbox only), mapped to root inside.
        os.chown(cwd, UNPRIVILEGED_ID, UNPRIVILEGED_ID)
        os.setgroups([])
        os.setresgid(UNPRIVILEGED_ID, UNPRIVILEGED_ID, UNPRIVILEGED_ID)
        os.setresuid(UNPRIVILEGED_ID, UNPRIVILEGED_ID, UNPRIVILEGED_ID)
        libc.prctl(4, 1)  # PR_SET_DUMPABLE, so that we may write our own /proc files
        check(libc.unshare(NEWUSER), "unshare the user namespace")
        map_root_to(UNPRIVILEGED_ID, UNPRIVILEGED_ID)
    write("/proc/sys/user/max_user_namespaces", "0")  # none nested in ours
    for capability in range(64):
        libc.prctl(24, capability, 0, 0, 0)  # PR_CAPBSET_DROP; past the last one: EINVAL
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this pid
    check(libc.capset(header, (ctypes.c_uint32 * 6)()), "drop capabilities")
    check(libc.prctl(38, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    os.chdir(cwd)

def map_root_to(uid, gid):
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"0 {uid} 1")
    write("/proc/self/gid_map", f"0 {gid} 1")

def relay(status):
    # Ends this process the way the program ended.
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))

NEWUSER, NEWNS, NEWPID, NEWNET = 0x10000000, 0x00020000, 0x20000000, 0x40000000
NEWIPC, NEWUTS = 0x08000000, 0x04000000  # System V IPC objects; the host name
PIVOT_ROOT, KEYCTL = config["syscalls"] or (None, None)

def isolate():
    # Returns in the program's process only; the launcher and the init end in os._exit.
    # Root makes the namespaces directly (they then belong to the machine's user namespace
    # and the program, nobody in a user namespace of its own, holds no capability over
    # them); anyone else needs a user namespace first.
    control = config["control_fd"]
    try:
        with open("solution.py", "rb") as file:
            source = file.read()
        config["in_user_namespace"] = os.geteuid() != 0
        if config["in_user_namespace"]:
            uid, gid = os.geteuid(), os.getegid()
            check(libc.unshare(NEWUSER | NEWNS | NEWPID | NEWNET | NEWIPC | NEWUTS), "unshare")
            map_root_to(uid, gid)
            die_with_parent(config["parent_pid"])  # in case the new credentials reset it
        else:
            check(libc.unshare(NEWNS | NEWPID | NEWNET | NEWIPC | NEWUTS), "unshare")
    except OSError as error:
        os.write(control, f"launcher: {error}".encode())
        os._exit(SETUP_EXIT_CODE)
    alive_read, alive_write = os.pipe()  # EOF on alive_read: the launcher has died
    status_read, status_write = os.pipe()
    init = os.fork()
    if init:
        os.close(alive_read)
        os.close(status_write)
        os.waitpid(init, 0)
        with os.fdopen(status_read, "rb") as pipe:
            report = pipe.read().decode()
        if report.startswith("status "):
            relay(int(report.split()[1]))
        os.write(control, (report or "init ended without a report").encode())
        os._exit(SETUP_EXIT_CODE)
    os.close(control)
    os.close(alive_write)
    os.close(status_read)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as PID 1 the default is to ignore it
    try:
        build_root(source)
    except BaseException as error:
        os.write(status_write, f"init: {error!r}".encode())
        os._exit(1)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG, after the last change of uid
    os.set_blocking(alive_read, False)
    try:
        if os.read(alive_read, 1) == b"":
            os._exit(1)  # the launcher died before the line above took effect
    except BlockingIOError:
        pass
    libc.prctl(4, 0)  # PR_SET_DUMPABLE: the program may not ptrace the init or open its memory
    program = os.fork()
    if program:
        _, status = os.waitpid(program, 0)
        os.write(status_write, f"status {status}".encode())
        os._exit(0)
    libc.prctl(4, 1)  # ... but its own /proc files stay its own
    os.close(alive_read)
    os.close(status_write)

die_with_parent(config["parent_pid"])
if config["isolation"] == "namespaces":
    isolate()
    # Counted in the program's user namespace: the init, and the launcher unless it is root.
    extra_processes = 2 if config["in_user_namespace"] else 1
else:
    os.close(config["control_fd"])  # only the namespaces' setup reports on it
    extra_processes = 0
def cap(which, value):
    resource.setrlimit(which, (value, value))
resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_time_s"], limits["cpu_time_s"] + 1))
cap(resource.RLIMIT_AS, limits["memory_bytes"])
cap(resource.RLIMIT_FSIZE, limits["max_file_bytes"])
cap(resource.RLIMIT_NOFILE, limits["max_open_files"])
cap(resource.RLIMIT_NPROC, limits["max_processes"] + extra_processes)
# The launcher's ctypes would reach native code without the dlopen the hook refuses (its
# resolved functions, memmove); the program must import it anew, which the hook refuses.
del libc, ctypes
for name in ("ctypes", "_ctypes", "ctypes._endian"):
    sys.modules.pop(name, None)
BLOCKED = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
           "subprocess.Popen", "os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym"}
class SandboxRefusal(PermissionError):
    pass
class SandboxImportRefusal(ImportError):  # what libraries that may use ctypes expect
    pass
def audit(event, args):
    if event in BLOCKED:
        raise SandboxRefusal("sandbox refuses " + event)
    if event == "import" and args[0] in ("ctypes", "_ctypes"):
        raise SandboxImportRefusal("sandbox refuses import " + args[0])
sys.addaudithook(audit)
sys.argv = ["solution.py"]
try:
    runpy.run_path("solution.py", run_name="__main__")
except MemoryError:
    os._exit(MEMORY_EXIT_CODE)
except (SandboxRefusal, SandboxImportRefusal) as refusal:
    sys.stderr.write(str(refusal) + "\n")
    sys.stderr.flush()
    os._exit(FORBIDDEN_EXIT_CODE)
"""
for _name, _value in (
    ("MEMORY_EXIT_CODE", MEMORY_EXIT_CODE),
    ("FORBIDDEN_EXIT_CODE", FORBIDDEN_EXIT_CODE),
    ("SETUP_EXIT_CODE", SETUP_EXIT_CODE),
    ("UNPRIVILEGED_ID", UNPRIVILEGED_ID),
):
    _LAUNCHER = _LAUNCHER.replace(_name, str(_value))


class SandboxSetupError(RuntimeError):
    """The launcher could not build the namespaces: a fault of the machine, not the program."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Resource limits and isolation of one sandboxed run.

    Attributes:
      wall_time_s: wall-clock limit, seconds.
      cpu_time_s: CPU-time limit, whole seconds (``RLIMIT_CPU`` granularity).
      memory_bytes: address-space limit (``RLIMIT_AS``); the interpreter needs ~30 MB.
      max_processes: ``RLIMIT_NPROC``; counts the program's processes and threads, so 1
        forbids new ones. The kernel ignores it for root, which is why the audit hook
        exists; with namespaces the program is never root outside, so it holds.
      max_output_bytes: stdout + stderr beyond this kill the program.
      max_file_bytes: largest file the program may write (``RLIMIT_FSIZE``).
      max_open_files: ``RLIMIT_NOFILE``.
      max_disk_bytes: size of the private tmpfs holding ``/tmp`` and the working directory
        (namespaces only; in limits-only mode the working directory is on the real disk).
      isolation: ``"auto"`` uses namespaces where ``isolation_mode()`` finds them and
        falls back to the limits alone; ``"namespaces"`` raises ``SandboxSetupError``
        where they are refused; ``"limits-only"`` never uses them.
    """

    wall_time_s: float = 5.0
    cpu_time_s: int = 2
    memory_bytes: int = 512 * 2**20
    max_processes: int = 1
    max_output_bytes: int = 2**20
    max_file_bytes: int = 2**20
    max_open_files: int = 64
    max_disk_bytes: int = 16 * 2**20
    isolation: Isolation = "auto"

    def __post_init__(self):
        if self.wall_time_s <= 0:
            raise ValueError(f"wall_time_s must be > 0, got {self.wall_time_s}")
        for name in ("cpu_time_s", "memory_bytes", "max_processes", "max_output_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_file_bytes < 0 or self.max_open_files < 16:
            raise ValueError("max_file_bytes must be >= 0 and max_open_files >= 16")
        if self.max_disk_bytes < 2**16:
            raise ValueError(f"max_disk_bytes must be >= 65536, got {self.max_disk_bytes}")
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {list(ISOLATIONS)}, got {self.isolation}")


@dataclass(frozen=True)
class SandboxResult:
    """What one run did: a status (``"ok"`` or a failure), exit code, output, time."""

    status: SandboxStatus
    returncode: int | None
    stdout: str
    stderr: str
    wall_time_s: float


def run_python(source: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Runs ``source`` as ``__main__`` in a limited child interpreter, feeding ``stdin``.

    Returns ``status="ok"`` only for exit status 0 within every limit; otherwise the
    status names the limit hit or ``"runtime_error"``. Raises ``SandboxSetupError`` when
    ``limits.isolation == "namespaces"`` and the kernel refuses them.
    """
    limits = limits or SandboxLimits()
    if limits.isolation == "limits-only":
        return _run(source, stdin, limits, "limits-only")
    mode, reason = _probe()
    if limits.isolation == "namespaces" and mode != "namespaces":
        raise SandboxSetupError(f"namespaces unavailable: {reason}")
    return _run(source, stdin, limits, mode)


def isolation_mode() -> IsolationMode:
    """``"namespaces"`` where this process's sandbox runs programs in namespaces, else
    ``"limits-only"`` (logged as a warning the first time): what a run summary records as
    ``sandbox_isolation``.

    Decided once per process by running a probe program in namespaces (~50 ms) and
    checking from inside that it is PID 2, sees in ``/`` only the sandbox's mount points
    and the view (no ``/etc``, no home) and cannot reach even the loopback address: the
    kernel's answer, not a guess from sysctls that differ between distributions.
    """
    return _probe()[0]


def isolation_refusal() -> str:
    """Why this process's sandbox runs with limits only: the probe's failure (the
    kernel's refusal, or what the probe program saw); ``""`` with namespaces."""
    return _probe()[1]


# Its PID, what it sees in ``/`` and how a connection to the loopback address fails: with
# namespaces 2, the view alone and ENETUNREACH (the loopback interface is down).
_PROBE = """
import errno, os, socket
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1).close()
    network = "connected"
except OSError as error:
    network = errno.errorcode.get(error.errno or 0, repr(error))
print(os.getpid(), sorted(os.listdir("/")), network)
"""


@functools.cache
def _probe() -> tuple[IsolationMode, str]:
    """The isolation this process can have and, for ``"limits-only"``, why."""
    if not sys.platform.startswith("linux"):
        reason = f"namespaces are Linux only, this is {sys.platform}"
    elif os.uname().machine not in _SYSCALLS:
        reason = f"no pivot_root system call number known for {os.uname().machine}"
    else:
        expected = f"2 {_root_entries(_filesystem_view())} ENETUNREACH\n"
        try:
            result = _run(_PROBE, "", SandboxLimits(), "namespaces")
        except SandboxSetupError as error:
            reason = str(error)
        else:
            if result.stdout == expected:
                return "namespaces", ""
            reason = f"probe program: {result.status}, {result.stdout!r} {result.stderr[-300:]!r}"
    _LOGGER.warning(
        "sandbox: namespaces refused (%s); programs run with limits only and can read the"
        " user's files and use the network",
        reason,
    )
    return "limits-only", reason


@functools.cache
def _filesystem_view() -> tuple[tuple[str, str, str], ...]:
    """``(path, "dir" | "symlink", link target)`` for what a program sees read-only: the
    Python installation and the shared-library directories, outermost first.

    Wherever the installation lives, its paths never clash with the sandbox's own mount
    points (``_SANDBOX_MOUNTS``): a prefix below one of them (a venv under ``/tmp``) is
    bound inside it after it is mounted, a prefix that holds one (``/``, or a Python
    installed with prefix ``/tmp``) is replaced by the directories Python reads from it
    (``sysconfig``'s library paths), a path through ``/proc`` by the path it names, and a
    symlinked prefix is shown with its target.
    """
    candidates: set[str] = set()
    for prefix in (sys.base_prefix, sys.prefix):
        prefix = os.path.abspath(prefix)
        if _within(prefix, "/proc"):  # /proc/self/root/...: the path it names
            prefix = os.path.realpath(prefix)
        if any(_within(mount_point, prefix) for mount_point in _SANDBOX_MOUNTS + ("/",)):
            paths = sysconfig.get_paths()
            names = ("stdlib", "platstdlib", "purelib", "platlib")
            candidates.update(os.path.abspath(paths[name]) for name in names if name in paths)
        else:
            candidates.add(prefix)
    for path in list(candidates):
        if _within(path, "/proc"):
            candidates.discard(path)
            candidates.add(os.path.realpath(path))
        elif os.path.islink(path):
            candidates.add(os.path.realpath(path))
    ordered = sorted(candidates) + [path for path in _LIBRARY_DIRS if os.path.lexists(path)]
    view: list[tuple[str, str, str]] = []
    for path in ordered:
        if any(_within(path, seen) for seen, _, _ in view):
            continue  # already visible through a directory bound above it
        if any(_within(mount_point, path) for mount_point in _SANDBOX_MOUNTS + ("/",)):
            continue  # would show the host's /tmp, /dev or /proc (sysconfig's paths inside)
        if os.path.islink(path):
            view.append((path, "symlink", os.readlink(path)))
        elif os.path.isdir(path):
            view.append((path, "dir", ""))
    return tuple(view)


def _within(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or lies below it (both absolute, normalised)."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _root_entries(view: tuple[tuple[str, str, str], ...]) -> list[str]:
    """The names a program in namespaces sees in ``/``: the sandbox's mount points and the
    first component of each path of the view, sorted."""
    names = {mount_point.strip("/") for mount_point in _SANDBOX_MOUNTS}
    names.update(path.split("/")[1] for path, _, _ in view)
    return sorted(names)


def _working_directory(workdir: str, view: tuple[tuple[str, str, str], ...]) -> str:
    """The program's working directory on its private ``/tmp``, named after ``workdir``
    and clear of every path of the view (which may lie under ``/tmp`` too)."""
    cwd = "/tmp/" + os.path.basename(workdir)
    while any(_within(path, cwd) or _within(cwd, path) for path, _, _ in view):
        cwd += "-work"
    return cwd


def _run(source: str, stdin: str, limits: SandboxLimits, mode: IsolationMode) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="rlaxkit-sandbox-") as workdir:
        Path(workdir, "solution.py").write_text(source, encoding="utf-8")
        stdin_path = Path(workdir, "stdin.txt")
        stdin_path.write_text(stdin, encoding="utf-8")
        # With namespaces the program's working directory is on its private /tmp.
        view = _filesystem_view()
        cwd = _working_directory(workdir, view) if mode == "namespaces" else workdir
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": cwd, "TMPDIR": cwd}
        # Numerical libraries start a thread per core at import, which RLIMIT_NPROC refuses.
        env |= {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        control_read, control_write = os.pipe()  # the launcher's reason when setup fails
        config = {
            "limits": asdict(limits),
            "parent_pid": os.getpid(),
            "isolation": mode,
            "control_fd": control_write,
            "root": os.path.realpath(workdir),
            "cwd": cwd,
            "view": view,
            "devices": _DEVICES,
            "syscalls": _SYSCALLS.get(os.uname().machine),
        }
        command = [sys.executable, "-I", "-B", "-c", _LAUNCHER, json.dumps(config)]
        start = time.monotonic()
        try:
            with stdin_path.open("rb") as stdin_file:
                process = subprocess.Popen(
                    command,
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=workdir,
                    env=env,
                    start_new_session=True,  # its own process group, killed as a whole
                    pass_fds=(control_write,),
                )
        except BaseException:
            os.close(control_read)
            raise
        finally:
            os.close(control_write)
        try:
            stdout, stderr, killed_for = _collect(process, start + limits.wall_time_s, limits)
        finally:
            _kill_group(process)
            process.wait()
            setup_error = _read_all(control_read)
        elapsed = time.monotonic() - start
    if setup_error:
        raise SandboxSetupError(setup_error)
    status = killed_for or _status(process.returncode, stderr, elapsed, limits)
    return SandboxResult(
        status=status,
        returncode=process.returncode,
        stdout=stdout.decode("utf-8", errors="replace"),
        stderr=stderr.decode("utf-8", errors="replace"),
        wall_time_s=elapsed,
    )


def _read_all(fd: int) -> str:
    """What is waiting on the pipe ``fd`` (the writers have ended), then closes it."""
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, _READ_CHUNK_BYTES):
            chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")


def _collect(
    process: subprocess.Popen, deadline: float, limits: SandboxLimits
) -> tuple[bytes, bytes, SandboxStatus | None]:
    """Reads both pipes until EOF and exit, or until a deadline or output cap is passed."""
    out_pipe, err_pipe = process.stdout, process.stderr
    if out_pipe is None or err_pipe is None:
        raise ValueError("process: must be started with stdout and stderr piped")
    outputs: dict[int, list[bytes]] = {out_pipe.fileno(): [], err_pipe.fileno(): []}
    total_bytes = 0
    killed_for: SandboxStatus | None = None
    with selectors.DefaultSelector() as selector:
        for pipe in (out_pipe, err_pipe):
            os.set_blocking(pipe.fileno(), False)
            selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map() and killed_for is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed_for = "wall_timeout"
                break
            for key, _ in selector.select(remaining):
                data = os.read(key.fd, _READ_CHUNK_BYTES)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                total_bytes += len(data)
                if total_bytes > limits.max_output_bytes:
                    killed_for = "output_limit"
                    break
                outputs[key.fd].append(data)
    if killed_for is None:
        # Both pipes are closed; the program may still be running (it closed them itself).
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.001))
        except subprocess.TimeoutExpired:
            killed_for = "wall_timeout"
    stdout = b"".join(outputs[out_pipe.fileno()])
    stderr = b"".join(outputs[err_pipe.fileno()])
    out_pipe.close()
    err_pipe.close()
    return stdout, stderr, killed_for


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILLs the child's process group (the child and anything it left behind)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _status(
    returncode: int, stderr: bytes, elapsed_s: float, limits: SandboxLimits
) -> SandboxStatus:
    if returncode == 0:
        return "ok"
    if returncode == MEMORY_EXIT_CODE or (returncode < 0 and b"MemoryError" in stderr):
        return MEMORY_LIMIT
    if returncode == FORBIDDEN_EXIT_CODE:
        return FORBIDDEN_OPERATION
    if returncode == -signal.SIGXCPU:
        return CPU_TIME_LIMIT
    if returncode == -signal.SIGKILL and elapsed_s >= limits.cpu_time_s:
        return CPU_TIME_LIMIT  # the hard limit, reached by a program that ignored SIGXCPU
    if returncode == -signal.SIGXFSZ:
        return OUTPUT_LIMIT
    return RUNTIME_ERROR
