"""The code sandbox isolates wherever Python lives: a virtualenv under ``/tmp``, in the home
directory, under ``/opt``, on a path with spaces, under ``/dev/shm``, or reached through a
symlink. From each, a child interpreter of that venv asks for the isolation mode and runs
five escape programs: a host file next to the venv, the checker's file (the problems with
their expected outputs), a connection to 127.0.0.1, a write outside its directory (next to
the venv and in the venv itself), and the caller's environment.

Where the machine offers namespaces (``sandbox_machine.namespaces_refused()`` is ``None``),
limits-only from any of these places is a failure, not a skip.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_machine import namespaces_refused

REPOSITORY = Path(__file__).resolve().parents[1]
# The test's own packages (numpy, rlaxkit's dependencies), lent to the bare venvs.
PACKAGES = [path for path in sys.path if path.endswith(("site-packages", "dist-packages"))]

# Run by the venv's interpreter, in the directory that holds the venv: argv[1] is that
# directory. Prints the mode, the probe's reason and, for each escape, what gave it away.
CHILD = r"""
import json, os, socket, sys
from rlaxkit.tasks import isolation_mode, isolation_refusal, run_python

place = sys.argv[1]
token = os.environ["RLAXKIT_ESCAPE_TOKEN"]
listener = socket.create_server(("127.0.0.1", 0))
listener.setblocking(False)
port = listener.getsockname()[1]
TRY = '''
import os, sys
def attempt(action):
    try:
        print(action())
    except BaseException as error:
        print("refused:", type(error).__name__, file=sys.stderr)
'''
programs = {
    "host_file": f"attempt(lambda: open({place + '/secret'!r}).read())\n"
                 "attempt(lambda: open('/etc/passwd').read())",
    "checker_file": f"attempt(lambda: open({place + '/problems.jsonl'!r}).read())",
    "connect_loopback": "import socket\n"
                        f"attempt(lambda: socket.create_connection(('127.0.0.1', {port}), 1))",
    "write_outside": f"attempt(lambda: open({place + '/pwned'!r}, 'w').write('x'))\n"
                     f"attempt(lambda: open({sys.prefix + '/pwned'!r}, 'w').write('x'))\n"
                     f"attempt(lambda: open('/tmp/rlaxkit-pwned-{token}', 'w').write('x'))",
    "caller_environment": "attempt(lambda: dict(os.environ))\n"
                          f"for pid in (1, {os.getpid()}, os.getppid(), 'self'):\n"
                          "    attempt(lambda: open(f'/proc/{pid}/environ', 'rb').read())",
}
escapes = {}
for name, source in programs.items():
    result = run_python(TRY + source)
    clues = []
    if token in result.stdout + result.stderr or "root:" in result.stdout:
        clues.append("printed a secret")
    if name == "connect_loopback":
        try:
            listener.accept()[0].close()
            clues.append("connected")
        except BlockingIOError:
            pass
    for path in (place + "/pwned", sys.prefix + "/pwned", f"/tmp/rlaxkit-pwned-{token}"):
        if os.path.exists(path):
            os.unlink(path)
            clues.append("wrote " + path)
    escapes[name] = clues
print(json.dumps({"mode": isolation_mode(), "reason": isolation_refusal(), "prefix": sys.prefix,
                  "escapes": escapes}))
"""


def _writable(directory: Path) -> str | None:
    """Why a venv cannot be made in ``directory`` (``None``: it can)."""
    if not directory.is_dir():
        return f"{directory} does not exist on this machine"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable by this user"
    return None


@pytest.fixture
def place(request) -> Iterator[tuple[Path, Path]]:
    """``(directory holding the venv, the venv's interpreter)`` for the location asked."""
    where = request.param
    parent = {
        "tmp": Path("/tmp"),
        "home": Path.home(),
        "opt": Path("/opt"),
        "dev_shm": Path("/dev/shm"),
        "spaces": Path("/tmp"),
        "symlink": Path(tempfile.gettempdir()),
    }[where]
    lacking = _writable(parent)
    if lacking:
        pytest.skip(lacking)
    directory = Path(tempfile.mkdtemp(prefix="rlaxkit-venv-", dir=parent))
    try:
        if where == "spaces":
            directory = directory / "my venvs"
            directory.mkdir()
        made = directory / ".venv"
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(made)],
            check=True,
            capture_output=True,
        )
        venv = made
        if where == "symlink":
            venv = directory / "current"
            venv.symlink_to(made)
        yield directory, venv / "bin" / "python"
    finally:
        top = directory.parent if where == "spaces" else directory
        shutil.rmtree(top)


LOCATIONS = ["tmp", "home", "opt", "spaces", "dev_shm", "symlink"]


@pytest.mark.parametrize("place", LOCATIONS, indirect=True)
def test_sandbox_isolates_from_a_venv_there(place):
    directory, python = place
    token = "rlaxkit-secret-" + secrets.token_hex(8)
    (directory / "secret").write_text(token)
    (directory / "problems.jsonl").write_text(json.dumps({"answer": [{"output": token}]}))
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": os.pathsep.join([str(REPOSITORY), *PACKAGES]),
        "RLAXKIT_ESCAPE_TOKEN": token,
    }
    child = subprocess.run(
        [str(python), "-c", textwrap.dedent(CHILD), str(directory)],
        capture_output=True,
        text=True,
        cwd=directory,  # the caller's working directory is there too
        env=env,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.splitlines()[-1])
    assert report["prefix"].startswith(str(directory))  # the venv's, not the test's
    refused = namespaces_refused()
    if report["mode"] != "namespaces":
        if refused is None:
            pytest.fail(
                f"the machine offers namespaces but the sandbox ran limits-only from"
                f" {report['prefix']}: {report['reason']}"
            )
        pytest.skip(f"this machine refuses namespaces: {refused}")
    assert report["escapes"] == {name: [] for name in report["escapes"]}
    assert len(report["escapes"]) == 5


@pytest.mark.parametrize("prefix", ["/", "/tmp", "/dev", "/proc/self/root/tmp"])
def test_a_prefix_that_holds_a_mount_point_of_the_sandbox_shows_pythons_directories(
    monkeypatch, prefix
):
    """A Python installed with prefix ``/`` (or ``/tmp``) would show the whole host, or
    hide the sandbox's own ``/tmp``: its library directories are bound instead."""
    from rlaxkit.tasks import sandbox

    monkeypatch.setattr(sys, "prefix", prefix)
    monkeypatch.setattr(sys, "base_prefix", prefix)
    paths = [path for path, _, _ in sandbox._filesystem_view.__wrapped__()]
    for mount_point in ("/", "/tmp", "/dev", "/proc"):
        assert not any(sandbox._within(mount_point, path) for path in paths), paths
    stdlib = sysconfig.get_paths()["stdlib"]
    assert any(sandbox._within(stdlib, path) for path in paths), (stdlib, paths)
