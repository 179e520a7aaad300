"""Run an untrusted Python program in a child process with hard limits.

Each run gets a fresh temporary working directory, an environment with nothing inherited
(no tokens or keys from the parent), and these limits:

* wall-clock time (the whole process group is killed at the deadline);
* CPU time (``RLIMIT_CPU``: ``SIGXCPU`` at the limit, ``SIGKILL`` a second later);
* address space (``RLIMIT_AS``: allocations beyond it raise ``MemoryError``);
* processes (``RLIMIT_NPROC``) plus an audit hook that refuses ``fork``, ``exec``,
  ``system``, ``posix_spawn``, ``subprocess``, ``kill`` and ``ctypes`` loading. The hook
  matters when running as root, where the kernel ignores ``RLIMIT_NPROC``;
* output: stdout and stderr are read incrementally and the program is killed once they
  exceed ``max_output_bytes``, so a gigabyte of output never lands in memory; files it
  writes are capped by ``RLIMIT_FSIZE``;
* lifetime: on Linux the child is SIGKILLed when the process that started it dies
  (``PR_SET_PDEATHSIG``), so a reward worker killed for a timeout leaks no program.

The limits are set by a small launcher inside the child (``resource.setrlimit``), not by
a ``preexec_fn``, which is unsafe in a threaded parent (and JAX starts threads).

This stops runaway and careless programs, not a determined attacker: the child still
shares the kernel, the file system (read access) and the network. Run adversarial code
behind an OS-level boundary (a container, gVisor, a separate VM).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
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
MEMORY_EXIT_CODE = 97  # the launcher's exit status after an uncaught MemoryError
FORBIDDEN_EXIT_CODE = 98  # ... after an uncaught refusal by the audit hook
_READ_CHUNK_BYTES = 65536

_LAUNCHER = """
import ctypes, json, os, resource, runpy, signal, sys
limits = json.loads(sys.argv[1])
if sys.platform.startswith("linux"):
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with our parent
if os.getppid() != int(sys.argv[2]):
    os._exit(1)  # the parent died before the line above took effect
def cap(which, value):
    resource.setrlimit(which, (value, value))
cap(resource.RLIMIT_CORE, 0)
resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_time_s"], limits["cpu_time_s"] + 1))
cap(resource.RLIMIT_AS, limits["memory_bytes"])
cap(resource.RLIMIT_FSIZE, limits["max_file_bytes"])
cap(resource.RLIMIT_NOFILE, limits["max_open_files"])
cap(resource.RLIMIT_NPROC, limits["max_processes"])
BLOCKED = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
           "subprocess.Popen", "os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym"}
class SandboxRefusal(PermissionError):
    pass
def audit(event, args):
    if event in BLOCKED:
        raise SandboxRefusal("sandbox refuses " + event)
sys.addaudithook(audit)
sys.argv = ["solution.py"]
try:
    runpy.run_path("solution.py", run_name="__main__")
except MemoryError:
    os._exit(MEMORY_EXIT_CODE)
except SandboxRefusal as refusal:
    sys.stderr.write(str(refusal) + "\\n")
    sys.stderr.flush()
    os._exit(FORBIDDEN_EXIT_CODE)
""".replace("MEMORY_EXIT_CODE", str(MEMORY_EXIT_CODE)).replace(
    "FORBIDDEN_EXIT_CODE", str(FORBIDDEN_EXIT_CODE)
)


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Resource limits of one sandboxed run.

    Attributes:
      wall_time_s: wall-clock limit, seconds.
      cpu_time_s: CPU-time limit, whole seconds (``RLIMIT_CPU`` granularity).
      memory_bytes: address-space limit (``RLIMIT_AS``); the interpreter needs ~30 MB.
      max_processes: ``RLIMIT_NPROC``; counts all of the user's processes and threads,
        so 1 forbids new ones (ignored by the kernel for root, hence the audit hook).
      max_output_bytes: stdout + stderr beyond this kill the program.
      max_file_bytes: largest file the program may write (``RLIMIT_FSIZE``).
      max_open_files: ``RLIMIT_NOFILE``.
    """

    wall_time_s: float = 5.0
    cpu_time_s: int = 2
    memory_bytes: int = 512 * 2**20
    max_processes: int = 1
    max_output_bytes: int = 2**20
    max_file_bytes: int = 2**20
    max_open_files: int = 64

    def __post_init__(self):
        if self.wall_time_s <= 0:
            raise ValueError(f"wall_time_s must be > 0, got {self.wall_time_s}")
        for name in ("cpu_time_s", "memory_bytes", "max_processes", "max_output_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_file_bytes < 0 or self.max_open_files < 16:
            raise ValueError("max_file_bytes must be >= 0 and max_open_files >= 16")


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
    status names the limit hit or ``"runtime_error"``.
    """
    limits = limits or SandboxLimits()
    with tempfile.TemporaryDirectory(prefix="rlaxkit-sandbox-") as workdir:
        Path(workdir, "solution.py").write_text(source, encoding="utf-8")
        stdin_path = Path(workdir, "stdin.txt")
        stdin_path.write_text(stdin, encoding="utf-8")
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        command = [
            sys.executable,
            "-I",
            "-B",
            "-c",
            _LAUNCHER,
            json.dumps(asdict(limits)),
            str(os.getpid()),
        ]
        start = time.monotonic()
        with stdin_path.open("rb") as stdin_file:
            process = subprocess.Popen(
                command,
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=env,
                start_new_session=True,  # its own process group, killed as a whole
            )
        try:
            stdout, stderr, killed_for = _collect(process, start + limits.wall_time_s, limits)
        finally:
            _kill_group(process)
            process.wait()
        elapsed = time.monotonic() - start
    status = killed_for or _status(process.returncode, stderr, elapsed, limits)
    return SandboxResult(
        status=status,
        returncode=process.returncode,
        stdout=stdout.decode("utf-8", errors="replace"),
        stderr=stderr.decode("utf-8", errors="replace"),
        wall_time_s=elapsed,
    )


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
