"""What this machine offers the code sandbox, asked of the kernel apart from the sandbox.

The sandbox's tests compare the sandbox's own answer (``isolation_mode()``) with this one:
where the kernel lets a process make user, mount, PID and network namespaces, a sandbox
that fell back to limits-only is a failure, never a reason to skip (STYLE rule 21).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys

# unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET), from a child
# interpreter, where the util-linux command is not installed.
_UNSHARE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000 | 0x00020000 | 0x20000000 | 0x40000000):
    sys.exit(os.strerror(ctypes.get_errno()))
"""


@functools.cache
def namespaces_refused() -> str | None:
    """Why this machine refuses the namespaces the sandbox needs; ``None`` where
    ``unshare --user --map-root-user --mount --pid --net true`` works."""
    if not sys.platform.startswith("linux"):
        return f"namespaces are Linux only, this is {sys.platform}"
    command = shutil.which("unshare")
    if command:
        argv = [command, "--user", "--map-root-user", "--mount", "--pid", "--fork", "--net"]
        done = subprocess.run([*argv, "true"], capture_output=True, text=True, timeout=30)
    else:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _UNSHARE], capture_output=True, text=True, timeout=30
        )
    if done.returncode:
        return f"unshare of user, mount, PID and network namespaces: {done.stderr.strip()}"
    return None


def sandbox_mode_line() -> str:
    """``sandbox isolation: <mode>`` and, for limits-only, the sandbox's reason and whether
    the machine offers namespaces: the line the suite prints."""
    from rlaxkit.tasks import isolation_mode, isolation_refusal

    mode, reason = isolation_mode(), isolation_refusal()
    if mode == "namespaces":
        return "sandbox isolation: namespaces"
    machine = namespaces_refused()
    offered = "the machine refuses them too" if machine else "THE MACHINE OFFERS THEM"
    return f"sandbox isolation: limits-only ({reason}; {offered})"
