"""Local processes for the control plane: start in their own process group, wait, stop, verify.

Each component runs as the leader of a new session (its pid is its process group id), so
stopping it with ``killpg`` also stops anything it spawned. A component is identified by pid
*and* start time, so a stale pid file never kills an unrelated process that reused the pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


class StartupError(RuntimeError):
    """A component exited or did not become ready in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports, all held open together while choosing them."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name, or None if the pid is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name is in parentheses and may contain spaces; fields follow the last ')'.
    return raw[raw.rfind(")") + 2 :].split()


def process_start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else None


def is_running(pid: int, start_time: int | None = None) -> bool:
    """True if ``pid`` exists, is not a zombie and (if given) started at ``start_time``."""
    fields = _proc_stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return start_time is None or int(fields[19]) == start_time


def group_members(pgids: Iterable[int]) -> list[int]:
    """Live (non-zombie) processes whose process group is one of ``pgids``."""
    wanted = set(pgids)
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _proc_stat(int(entry.name))
        if fields and fields[0] not in ("Z", "X") and int(fields[2]) in wanted:
            members.append(int(entry.name))
    return sorted(members)


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (e.g. a cluster directory)."""
    found = []
    own = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if text in cmdline and is_running(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL the child when the process that started it dies (Linux only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass(frozen=True)
class ProcessRecord:
    """What ``down`` needs to find and stop a component started by an earlier process."""

    name: str
    pid: int
    start_time: int | None
    argv: tuple[str, ...]
    log: str

    def running(self) -> bool:
        """True while the component's leader process is alive."""
        return is_running(self.pid, self.start_time)

    def to_json(self) -> dict[str, object]:
        """A JSON-serialisable form."""
        data = asdict(self)
        data["argv"] = list(self.argv)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> ProcessRecord:
        """Inverse of :meth:`to_json`."""
        argv = data.get("argv") or []
        start = data.get("start_time")
        return cls(
            name=str(data["name"]),
            pid=int(str(data["pid"])),
            start_time=int(str(start)) if start is not None else None,
            argv=tuple(str(arg) for arg in argv) if isinstance(argv, list) else (),
            log=str(data.get("log", "")),
        )


class ManagedProcess:
    """A component process: started in its own session, logging to a file."""

    def __init__(self, record: ProcessRecord, popen: subprocess.Popen[bytes] | None = None) -> None:
        self.record = record
        self._popen = popen

    @classmethod
    def start(
        cls,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        pid_dir: Path,
        cwd: Path,
        env: Mapping[str, str] | None = None,
        die_with_parent: bool = False,
    ) -> ManagedProcess:
        """Start ``argv`` as a new session leader; write ``pid_dir/<name>.pid``."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        pid_dir.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=dict(env) if env is not None else None,
                start_new_session=True,
                preexec_fn=_die_with_parent if die_with_parent else None,  # noqa: PLW1509
            )
        record = ProcessRecord(
            name=name,
            pid=popen.pid,
            start_time=process_start_time(popen.pid),
            argv=tuple(argv),
            log=str(log_path),
        )
        (pid_dir / f"{name}.pid").write_text(f"{popen.pid}\n")
        return cls(record, popen)

    @property
    def name(self) -> str:
        """The component name (also the log and pid file stem)."""
        return self.record.name

    def exited(self) -> int | None:
        """The exit code if the process has ended, else None."""
        if self._popen is not None:
            return self._popen.poll()
        return None if self.record.running() else -1

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the component's log, for error messages."""
        try:
            text = Path(self.record.log).read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def send(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the component's whole process group."""
        if self.record.running():
            _signal_group(self.record.pid, sig)

    def wait_gone(self, timeout: float) -> bool:
        """Wait until no process of the group is left; True if that happened within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._reap()
            if not group_members([self.record.pid]) and not self.record.running():
                return True
            time.sleep(0.05)
        return False

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout``, reap, verify."""
        pgid = self.record.pid
        if self.record.running():
            _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._reap()
            if not group_members([pgid]) and not self.record.running():
                break
            time.sleep(0.1)
        else:
            _signal_group(pgid, signal.SIGKILL)
            kill_deadline = time.monotonic() + 5.0
            while time.monotonic() < kill_deadline and group_members([pgid]):
                self._reap()
                time.sleep(0.05)
        self._reap()
        left = group_members([pgid])
        if left:
            raise RuntimeError(f"{self.name}: processes {left} survived SIGKILL")

    def _reap(self) -> None:
        if self._popen is not None:
            self._popen.poll()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def write_records(path: Path, processes: Iterable[ManagedProcess]) -> None:
    """Persist process records (JSON) so a later ``down`` can stop them."""
    path.write_text(json.dumps([proc.record.to_json() for proc in processes], indent=2) + "\n")


def read_records(path: Path) -> list[ProcessRecord]:
    """Inverse of :func:`write_records`; an absent file means no processes."""
    if not path.is_file():
        return []
    return [ProcessRecord.from_json(item) for item in json.loads(path.read_text())]


def http_status(url: str, *, context: ssl.SSLContext | None = None, token: str | None = None) -> int:
    """GET ``url`` and return the HTTP status (0 when the connection fails)."""
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, OSError):
        return 0


def wait_until(
    what: str,
    ready: Callable[[], bool],
    *,
    timeout: float,
    process: ManagedProcess | None = None,
    interval: float = 0.2,
) -> float:
    """Poll ``ready`` until true; fail fast if ``process`` exits. Returns the seconds waited."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        if ready():
            return time.monotonic() - started
        if process is not None and process.exited() is not None:
            raise StartupError(
                f"{process.name} exited (code {process.exited()}) while waiting for {what}; "
                f"log {process.record.log}:\n{process.log_tail()}"
            )
        if time.monotonic() > deadline:
            tail = f"; log {process.record.log}:\n{process.log_tail()}" if process else ""
            raise StartupError(f"timed out after {timeout:.0f}s waiting for {what}{tail}")
        time.sleep(interval)
