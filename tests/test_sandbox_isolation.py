"""Escape suite for the code sandbox: programs that try to read the user's and other
programs' files, write outside their directory, reach the network, start processes or
signal others. Each runs through ``run_python`` and must fail or be contained.

With namespaces (``isolation_mode() == "namespaces"``) every case runs. Where the machine
offers namespaces (``unshare`` works) and the sandbox fell back to limits-only anyway, every
case that only namespaces contain fails (STYLE rule 21): a guard that is off is a failure.
Only where the machine itself refuses them are those cases skipped, each naming the
kernel's refusal and why limits-only mode cannot contain it; the rest still run.
``test_no_escapes`` prints ``escapes: E of N (mode)``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from sandbox_machine import namespaces_refused

from rlaxkit.tasks import Problem, RewardRunner, RewardRunnerConfig, make_task
from rlaxkit.tasks.base import REWARD_TIMEOUT
from rlaxkit.tasks.sandbox import (
    SandboxLimits,
    SandboxResult,
    SandboxSetupError,
    isolation_mode,
    isolation_refusal,
    run_python,
)

MODE = isolation_mode()
LIMITS = SandboxLimits(
    wall_time_s=3.0,
    cpu_time_s=2,
    memory_bytes=256 * 2**20,
    max_file_bytes=2**20,
    max_disk_bytes=4 * 2**20,
)
IS_ROOT = os.geteuid() == 0
SHARED = "limits-only mode shares the user's file system"
NETWORK = "limits-only mode shares the host's network"
ROOT_NPROC = "root ignores RLIMIT_NPROC, and this path raises no audit event"
NO_HOOK = "pidfd_send_signal raises no audit event; only the PID namespace hides the pid"


@dataclass(frozen=True)
class Bait:
    """What the programs go after: a secret in places they must not reach."""

    token: str  # the secret; it must never appear in a program's output
    home: Path  # a home-like directory with a key file, outside the working directory
    run_dir: Path  # a run directory with a secret file
    sibling: Path  # another program's working directory, next to the program's own
    outside: Path  # a directory the programs try to write into
    listener: socket.socket  # listens on 127.0.0.1; nobody should reach it
    port: int  # the listener's
    sleeper_pid: int  # a process of the test's user, to read and kill


@dataclass(frozen=True)
class Escape:
    """One attempt: a program, how to tell it got out, and why limits-only mode cannot
    contain it (``None``: the limits and the audit hook suffice)."""

    source: Callable[[Bait], str]
    escaped: Callable[[SandboxResult, Bait], bool]
    limits_only_skip: str | None = None
    companion: Callable[[Bait], str] | None = None  # a program run at the same time
    limits: SandboxLimits = LIMITS


def printed_token(result: SandboxResult, bait: Bait) -> bool:
    return bait.token in result.stdout + result.stderr


def printed(marker: str) -> Callable[[SandboxResult, Bait], bool]:
    return lambda result, bait: marker in result.stdout


def left_file(*names: str) -> Callable[[SandboxResult, Bait], bool]:
    """Whether the program left any of ``names`` (formatted with the bait) on the host."""

    def escaped(result: SandboxResult, bait: Bait) -> bool:
        paths = [Path(name.format(bait=bait)) for name in names]
        found = [path for path in paths if path.exists()]
        for path in found:
            path.unlink()
        return bool(found)

    return escaped


def home_entries_listed(result: SandboxResult, bait: Bait) -> bool:
    """Whether the program listed the key file or a name in the user's real home other
    than the path down to the Python installation (which the sandbox shows)."""
    home = Path.home()
    prefixes = [Path(prefix) for prefix in (sys.base_prefix, sys.prefix)]
    shown = {
        prefix.relative_to(home).parts[0] for prefix in prefixes if prefix.is_relative_to(home)
    }
    private = {entry.name for entry in home.iterdir()} - shown
    return bool(set(result.stdout.split("\n")) & (private | {"id_ed25519"}))


def outlived(result: SandboxResult, bait: Bait) -> bool:
    """Whether a process with the token's file in its working directory is still alive a
    second after the run ended."""
    deadline = time.monotonic() + 1
    while _processes_with(bait.token) and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(_processes_with(bait.token))


def connected(result: SandboxResult, bait: Bait) -> bool:
    try:
        connection, _ = bait.listener.accept()
    except BlockingIOError:
        return False
    connection.close()
    return True


def sleeper_killed(result: SandboxResult, bait: Bait) -> bool:
    try:
        os.kill(bait.sleeper_pid, 0)
    except ProcessLookupError:
        return True
    return _zombie(bait.sleeper_pid)


def disk_filled(result: SandboxResult, bait: Bait) -> bool:
    written = [int(line) for line in result.stdout.split() if line.isdigit()]
    return bool(written) and max(written) > LIMITS.max_disk_bytes


def threads_started(result: SandboxResult, bait: Bait) -> bool:
    started = [int(line) for line in result.stdout.split() if line.isdigit()]
    return bool(started) and max(started) >= LIMITS.max_processes


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except FileNotFoundError:
        return True


def program(text: str) -> Callable[[Bait], str]:
    """A program whose ``{bait.…}`` fields are filled in; each attempt prints what it got
    and carries on after a refusal, so one program tries every route of its kind."""
    return lambda bait: textwrap.dedent(text).format(bait=bait, pid=os.getpid())


TRY = """
def attempt(action):
    try:
        print(action())
    except BaseException as error:
        print("refused:", type(error).__name__, file=sys.stderr)
"""

ESCAPES: dict[str, Escape] = {
    "read_etc_passwd": Escape(
        program("print(open('/etc/passwd').read())"),
        printed("root:"),
        SHARED,
    ),
    "read_home_key": Escape(
        program("print(open('{bait.home}/id_ed25519').read())"),
        printed_token,
        SHARED,
    ),
    "list_home": Escape(
        program(
            """
            import os, sys
            for home in (os.path.expanduser('~'), '{bait.home}', {home!r}):
                try:
                    print('\\n'.join(os.listdir(home)))
                except OSError as error:
                    print(error, file=sys.stderr)
            """.replace("{home!r}", repr(str(Path.home())))
        ),
        home_entries_listed,
        SHARED,
    ),
    "read_run_directory": Escape(
        program(
            "import os\nprint(os.listdir('{bait.run_dir}'), open('{bait.run_dir}/secret').read())"
        ),
        printed_token,
        SHARED,
    ),
    "read_proc_environ": Escape(
        program(
            "import sys" + TRY + "for pid in (1, {pid}, {bait.sleeper_pid}, 'self'):\n"
            "    attempt(lambda: open(f'/proc/{{pid}}/environ', 'rb').read())\n"
            "    attempt(lambda: open(f'/proc/{{pid}}/cmdline', 'rb').read())"
        ),
        printed_token,
        SHARED,
    ),
    "read_sibling_workdir": Escape(
        program(
            "import glob, sys" + TRY + "attempt(lambda: open('{bait.sibling}/secret').read())\n"
            "for path in glob.glob('/tmp/rlaxkit-*/secret'):\n"
            "    attempt(lambda: open(path).read())"
        ),
        printed_token,
        SHARED,
    ),
    "read_running_program": Escape(
        program(
            """
            import glob, time, sys
            time.sleep(0.5)  # the companion has written its secret by now
            for path in glob.glob('/tmp/rlaxkit-*/mine') + glob.glob('/proc/*/cwd/mine'):
                try:
                    print(open(path).read())
                except OSError as error:
                    print(error, file=sys.stderr)
            """
        ),
        printed_token,
        SHARED,
        companion=program("import time\nopen('mine', 'w').write('{bait.token}')\ntime.sleep(1.5)"),
    ),
    "read_repository": Escape(
        program(f"print(open({str(Path(__file__).parents[1] / 'pyproject.toml')!r}).read())"),
        printed("[project]"),
        SHARED,
    ),
    "write_outside": Escape(
        program(
            "import sys" + TRY + "attempt(lambda: open('{bait.outside}/pwned', 'w').write('x'))\n"
            "attempt(lambda: open('/tmp/rlaxkit-escape-{bait.token}', 'w').write('x'))"
        ),
        left_file("{bait.outside}/pwned", "/tmp/rlaxkit-escape-{bait.token}"),
        SHARED,
    ),
    "write_python_install": Escape(
        program(
            "import os\nopen(os.path.dirname(os.__file__) + '/rlaxkit-escape-{bait.token}', 'w')"
        ),
        left_file(os.path.dirname(os.__file__) + "/rlaxkit-escape-{bait.token}"),
        SHARED,
    ),
    "write_dev_shm": Escape(
        program("open('/dev/shm/rlaxkit-escape-{bait.token}', 'w').write('x')"),
        left_file("/dev/shm/rlaxkit-escape-{bait.token}"),
        SHARED,
    ),
    "fill_disk": Escape(
        program(
            """
            written = 0
            try:
                for index in range(10**6):
                    with open(f'block{{index}}', 'wb') as block:
                        block.write(b'x' * 2**19)
                    written += 2**19
            finally:
                print(written)
            """
        ),
        disk_filled,
        "limits-only mode writes to the real disk; only RLIMIT_FSIZE caps each file",
    ),
    "connect_tcp": Escape(
        program(
            "import socket\n"
            "socket.create_connection(('127.0.0.1', {bait.port}), timeout=1).send(b'x')"
        ),
        connected,
        NETWORK,
    ),
    "resolve_host_name": Escape(
        program("import socket\nprint(socket.getaddrinfo('example.com', 80))"),
        lambda result, bait: result.status == "ok",
        NETWORK,
    ),
    "fork": Escape(
        program("import os\nif os.fork() == 0:\n    print('FORKED')"),
        printed("FORKED"),
    ),
    "fork_without_audit": Escape(
        # subprocess's own primitive, called directly: it raises no audit event (3.11).
        program(
            """
            import _posixsubprocess, os
            pipe = os.pipe()
            _posixsubprocess.fork_exec(
                [b'/nonexistent'], [b'/nonexistent'], True, (), None, None, -1, -1, -1, -1,
                -1, -1, *pipe, True, False, 0, None, None, None, -1,
                lambda: os.write(1, b'FORKED\\n'), False)
            """
        ),
        printed("FORKED"),
        ROOT_NPROC if IS_ROOT else None,
    ),
    "exec": Escape(
        program("import os\nos.execv('/bin/sh', ['sh', '-c', 'echo EXECUTED'])"),
        printed("EXECUTED"),
    ),
    "ctypes": Escape(
        program(
            "import ctypes\nctypes.CDLL(None).puts(b'CTYPES')\nctypes.pythonapi.puts(b'CTYPES')"
        ),
        printed("CTYPES"),
    ),
    "thread_bomb": Escape(
        program(
            """
            import threading, time
            started = 0
            try:
                while started < 1000:
                    threading.Thread(target=time.sleep, args=(2,), daemon=True).start()
                    started += 1
            finally:
                print(started)
            """
        ),
        threads_started,
        ROOT_NPROC if IS_ROOT else None,
    ),
    "load_native_code": Escape(
        # A copy of an extension module in the working directory (its tmpfs is noexec). A
        # copy in a memfd does load: native code gets past the audit hook, not the
        # namespaces (the module docstring says so).
        program(
            """
            import importlib.util, os, shutil, _json
            path = shutil.copy(_json.__file__, os.path.abspath('_json.so'))
            spec = importlib.util.spec_from_file_location('_json', path)
            importlib.util.module_from_spec(spec)  # dlopen, then its init function
            print('NATIVE')
            """
        ),
        printed("NATIVE"),
        "limits-only mode's working directory is on a disk that allows exec",
    ),
    "read_hostname": Escape(
        program("import socket\nprint(socket.gethostname())"),
        lambda result, bait: socket.gethostname() in result.stdout.split(),
        "limits-only mode shares the host's name",
    ),
    "launcher_libc": Escape(
        # The launcher's own ctypes handle, found through the frames above the program.
        program(
            """
            import sys
            frame = sys._getframe()
            while frame is not None:
                if 'libc' in frame.f_globals:
                    frame.f_globals['libc'].prctl(15, b'pwned')  # PR_SET_NAME
                    print('LIBC')
                frame = frame.f_back
            """
        ),
        printed("LIBC"),
    ),
    "init_memory": Escape(
        program("open('/proc/1/mem', 'r+b')\nprint('OPENED')"),
        printed("OPENED"),
        "PID 1 is the machine's init, which the program may not open (the case is moot)",
    ),
    "forge_setup_error": Escape(
        # The pipe on which the launcher reports a failed setup (run_python would raise).
        program(
            """
            import json, os
            config = json.loads(open('/proc/self/cmdline').read().split('\\0')[5])
            os.write(config['control_fd'], b'forged')
            """
        ),
        lambda result, bait: False,
    ),
    "outlive_wall_limit": Escape(
        # A session of its own, out of the process group the wall limit kills.
        program("import os, time\nos.setsid()\nopen('{bait.token}', 'w').close()\ntime.sleep(30)"),
        outlived,
        limits=dataclasses.replace(LIMITS, wall_time_s=1.0),
    ),
    "signal_parent": Escape(
        program("import os, signal\nos.kill(os.getppid(), signal.SIGTERM)\nprint('SIGNALLED')"),
        printed("SIGNALLED"),
    ),
    "kill_test_process": Escape(
        program("import os, signal\nos.kill({pid}, signal.SIGTERM)\nprint('SIGNALLED')"),
        printed("SIGNALLED"),
    ),
    "kill_by_pidfd": Escape(
        program(
            "import os, signal\n"
            "signal.pidfd_send_signal(os.pidfd_open({bait.sleeper_pid}), signal.SIGKILL)"
        ),
        sleeper_killed,
        NO_HOOK,
    ),
}


@pytest.fixture(scope="module")
def bait(tmp_path_factory):
    token = "rlaxkit-secret-" + secrets.token_hex(8)
    root = tmp_path_factory.mktemp("bait")
    home, run_dir, outside = root / "home", root / "run", root / "outside"
    for directory in (home, run_dir, outside):
        directory.mkdir()
    (home / "id_ed25519").write_text(token)
    (run_dir / "secret").write_text(token)
    sibling = Path(tempfile.mkdtemp(prefix="rlaxkit-sandbox-"))
    (sibling / "secret").write_text(token)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    # Started with the secret in its environment, which /proc/<pid>/environ would show.
    sleeper = subprocess.Popen(["sleep", "60"], env={"RLAXKIT_ESCAPE_TOKEN": token})
    port = listener.getsockname()[1]
    yield Bait(token, home, run_dir, sibling, outside, listener, port, sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    listener.close()
    (sibling / "secret").unlink()
    sibling.rmdir()


@pytest.fixture(scope="module")
def outcomes(bait) -> dict[str, bool]:
    """Whether each case that runs in this mode escaped; one run of each for the module."""
    escaped = {}
    for name, escape in ESCAPES.items():
        if MODE == "limits-only" and escape.limits_only_skip:
            continue  # never run: some of them would do real harm there
        companion = None
        if escape.companion is not None:
            source = escape.companion(bait)
            companion = threading.Thread(target=run_python, args=(source, "", LIMITS))
            companion.start()
            time.sleep(0.2)
        try:
            result = run_python(escape.source(bait), limits=escape.limits)
        except SandboxSetupError:
            escaped[name] = True  # the program passed itself off as a broken sandbox
        else:
            escaped[name] = escape.escaped(result, bait)
        if companion is not None:
            companion.join()
    return escaped


def require_namespaces(why: str) -> None:
    """Returns with namespaces; else fails where the machine offers them (the sandbox
    fell back for a reason of its own) and skips, naming the kernel's refusal, where it
    does not."""
    if MODE == "namespaces":
        return
    refused = namespaces_refused()
    if refused is None:
        pytest.fail(
            "the machine offers namespaces (unshare works) but the sandbox runs limits-only"
            f" ({isolation_refusal()}): {why}"
        )
    pytest.skip(f"this machine refuses namespaces ({refused}); {why}")


def test_sandbox_uses_namespaces_where_the_machine_offers_them():
    if namespaces_refused() is None:
        assert MODE == "namespaces", isolation_refusal()
    else:
        assert MODE == "limits-only"


@pytest.mark.parametrize("name", list(ESCAPES))
def test_escape_is_contained(name, outcomes):
    reason = ESCAPES[name].limits_only_skip
    if reason:
        require_namespaces(f"limits-only: {reason}")
    assert not outcomes[name], f"{name} escaped the sandbox ({MODE})"


def test_no_escapes(outcomes, capsys, record_property):
    escapes = sum(outcomes.values())
    line = f"escapes: {escapes} of {len(outcomes)} ({MODE})"
    record_property("sandbox_escapes", line)
    with capsys.disabled():
        print("\n" + line)
    assert escapes == 0, sorted(name for name, escaped in outcomes.items() if escaped)
    if MODE == "namespaces":
        assert len(outcomes) == len(ESCAPES)  # none left out
    else:
        assert len(outcomes) >= 6


def test_programs_still_work_inside():
    source = """
        import json, os, sys, tempfile
        open('out.txt', 'w').write(sys.stdin.read().upper())
        with tempfile.NamedTemporaryFile('w') as scratch:
            scratch.write('x')
        print(json.dumps([open('out.txt').read(), os.getcwd() == os.path.expanduser('~')]))
    """
    result = run_python(textwrap.dedent(source), stdin="abc\n", limits=LIMITS)
    assert result.status == "ok", result.stderr
    assert json.loads(result.stdout) == ["ABC\n", True]


def test_namespace_view():
    require_namespaces("the view exists in namespaces only")
    source = """
        import os
        print(os.getpid(), os.getppid(), sorted(os.listdir('/')), sorted(os.listdir('/dev')))
        print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])
    """
    result = run_python(textwrap.dedent(source), limits=LIMITS)
    first, capabilities = result.stdout.splitlines()
    pid, parent, rest = first.split(" ", 2)
    assert (pid, parent) == ("2", "1")  # the init is PID 1; the host's pids are not there
    assert "'etc'" not in rest and "'home'" not in rest and "'shm'" not in rest
    assert "['null', 'random', 'urandom', 'zero']" in rest
    assert int(capabilities, 16) == 0


def test_killing_a_hung_reward_leaks_no_program_in_namespaces():
    require_namespaces("the PID namespace's init exists in namespaces only")
    # The program marks its working directory; the host sees it through /proc/<pid>/cwd.
    marker = "rlaxkit-hung-" + secrets.token_hex(6)
    task = make_task("code", limits=SandboxLimits(wall_time_s=60, cpu_time_s=60))
    source = f"import time\nopen({marker!r}, 'w').close()\ntime.sleep(60)\n"
    problem = Problem(id="hang", prompt="", answer=[{"input": "", "output": ""}])
    config = RewardRunnerConfig(mode="pool", num_workers=1, timeout_s=1.5)
    with RewardRunner.for_task(task, config) as runner:
        (result,) = runner.score([problem], [source])
    assert result.reason == REWARD_TIMEOUT
    deadline = time.monotonic() + 5
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _processes_with(marker)


def _processes_with(marker: str) -> list[int]:
    """Live processes whose working directory holds a file named ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and not _zombie(int(entry.name)):
            try:
                if (entry / "cwd" / marker).exists():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_fallback_warns_once_and_keeps_the_limits():
    # A machine without pivot_root (here: an unknown architecture) cannot build the root.
    script = """
        import os, logging
        from rlaxkit.tasks import sandbox
        uname = os.uname()
        os.uname = lambda: type(uname)((*uname[:4], 'pdp11'))
        print(sandbox.isolation_mode(), sandbox.isolation_mode())
        print(sandbox.run_python('import os; os.fork()').status)
        try:
            sandbox.run_python('', limits=sandbox.SandboxLimits(isolation='namespaces'))
        except sandbox.SandboxSetupError as error:
            print('refused:', error)
    """
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 0, child.stderr
    modes, status, refusal = child.stdout.splitlines()
    assert modes == "limits-only limits-only"
    assert status == "forbidden_operation"
    assert refusal.startswith("refused: namespaces unavailable: no pivot_root")
    assert child.stderr.count("namespaces refused") == 1


def test_isolation_is_validated():
    with pytest.raises(ValueError, match=r"isolation must be one of \['auto', 'namespaces'"):
        SandboxLimits(isolation="containers")  # type: ignore[arg-type]
    assert isolation_mode() in ("namespaces", "limits-only")
    if MODE == "namespaces":
        assert run_python("print(1)", limits=SandboxLimits(isolation="namespaces")).stdout == "1\n"
    else:
        with pytest.raises(SandboxSetupError):
            run_python("print(1)", limits=SandboxLimits(isolation="namespaces"))
