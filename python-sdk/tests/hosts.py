"""Simulated hosts for pytest: N network namespaces on this one machine (DESIGN.md §12).

A helper, not a test module. :class:`Hosts` starts ``tpuray-hosts`` (the Rust harness
``tests/src/bin/tpuray-hosts.rs``; path from ``TPURAY_HOSTS_BIN``, else
``<repo>/target/debug/tpuray-hosts``, or under ``CARGO_TARGET_DIR``; built with cargo
when missing), which makes the hosts and prints them as one JSON line. Each host has
its own address in 198.18.0.0/15 (``host0`` is 198.18.0.1, ...), its own ``/dev/shm``,
``/tmp``, ``HOME`` and hostname, and every host's name is in the shared ``/etc/hosts``.
The checkout, ``target/`` and its virtual environments are shared. Needs root.

Usage::

    from hosts import Hosts, hosts_fixture

    with Hosts(3) as hs:
        h0, h1 = hs.hosts[0], hs.hosts[1]
        server = h0.popen(["python3", "-m", "http.server", "8000"])
        out = h1.run(["python3", "-c", "import urllib.request as u;"
                      "print(u.urlopen('http://host0:8000').status)"],
                     capture_output=True, text=True, timeout=30)
        h0.partition()   # link down, silently; h0.heal() brings it back
        h0.crash()       # SIGKILL every process in h0 (the host stays usable)

    three_hosts = hosts_fixture(3)   # a pytest fixture, in a test module or conftest.py

    def test_something(three_hosts):
        three_hosts.hosts[0].run(["hostname"], check=True)

``Host.popen``/``Host.run`` take ``subprocess`` keyword arguments; the command runs
through ``nsenter`` in the host with ``HOME`` set to the host's and ``TPURAY_ADDRESS``,
``TPURAY_AUTH_TOKEN``, ``TPURAY_REGISTRY_DIR`` and ``TMPDIR`` removed (``env=`` adds
to that), in ``cwd`` (default: the repository root). Faults (``partition``, ``heal``,
``loss(pct)``, ``latency(ms)``, ``clear_faults``, ``crash``, ``freeze``, ``thaw``) go
to ``tpuray-hosts`` on its stdin and raise :class:`HostsError` when it answers
``err`` (``latency`` does on kernels without netem). Closing the :class:`Hosts` (or
leaving the ``with`` block, or the fixture's teardown) kills every process in every
host and removes everything; the fixture first prints the tail of every log under
each host's ``/tmp`` (pytest shows it when the test failed).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: How long ``tpuray-hosts`` may take to make the hosts or answer a command (s).
TIMEOUT = 120.0
_DROPPED_ENV = ("TPURAY_ADDRESS", "TPURAY_AUTH_TOKEN", "TPURAY_REGISTRY_DIR", "TMPDIR")


class HostsError(RuntimeError):
    """``tpuray-hosts`` refused a command (the message is its ``err`` line)."""


def hosts_bin() -> Path:
    """Path of ``tpuray-hosts``, built with cargo when missing (unless
    ``TPURAY_HOSTS_BIN`` names it)."""
    if os.environ.get("TPURAY_HOSTS_BIN"):
        return Path(os.environ["TPURAY_HOSTS_BIN"])
    target = REPO / os.environ.get("CARGO_TARGET_DIR", "target")
    path = target / "debug" / "tpuray-hosts"
    if not path.exists():
        subprocess.run(
            ["cargo", "build", "-q", "-p", "tpuray-tests", "--bin", "tpuray-hosts"],
            cwd=REPO,
            check=True,
            timeout=1800,
        )
    return path


class Host:
    """One simulated host: ``name``, ``address``, ``pid`` (of its holder), ``home``,
    ``tmp`` (its ``/tmp`` as seen from outside) and ``nsenter`` (the command prefix)."""

    def __init__(self, owner: "Hosts", info: dict):
        self._owner = owner
        self.name: str = info["name"]
        self.address: str = info["address"]
        self.pid: int = info["pid"]
        self.home = Path(info["home"])
        self.tmp = Path(info["tmp"])
        self.nsenter: list[str] = list(info["nsenter"])

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address}, pid={self.pid})"

    def argv(self, args) -> list[str]:
        """``args`` prefixed to run in this host (``--wd=.`` keeps the caller's cwd)."""
        if isinstance(args, (str, os.PathLike)):
            args = [args]
        return self.nsenter[:-1] + ["--wd=.", "--"] + [os.fspath(a) for a in args]

    def env(self, extra: dict | None = None) -> dict:
        """The environment commands get in this host, plus ``extra``."""
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
        env["HOME"] = str(self.home)
        env.update(extra or {})
        return env

    def popen(self, args, env: dict | None = None, **kwargs) -> subprocess.Popen:
        """``subprocess.Popen`` of ``args`` in this host (does not wait)."""
        kwargs.setdefault("cwd", REPO)
        return subprocess.Popen(self.argv(args), env=self.env(env), **kwargs)

    def run(self, args, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``args`` in this host (blocks; pass ``timeout=``)."""
        kwargs.setdefault("cwd", REPO)
        return subprocess.run(self.argv(args), env=self.env(env), **kwargs)

    def partition(self) -> None:
        """Cuts the host's link; its processes keep running."""
        self._owner.send(f"partition {self.name}")

    def heal(self) -> None:
        """Restores the link :meth:`partition` cut."""
        self._owner.send(f"heal {self.name}")

    def loss(self, percent: int) -> None:
        """Drops ``percent``% of the host's packets, in and out (0 removes it)."""
        self._owner.send(f"loss {self.name} {int(percent)}")

    def latency(self, ms: int) -> None:
        """Delays the host's outgoing packets; raises where the kernel has no netem."""
        self._owner.send(f"latency {self.name} {int(ms)}")

    def clear_faults(self) -> None:
        """Heals the link and removes loss and latency."""
        self._owner.send(f"clear {self.name}")

    def crash(self) -> None:
        """SIGKILLs every process in the host (blocks until they are gone)."""
        self._owner.send(f"crash {self.name}")

    def freeze(self) -> None:
        """SIGSTOPs every process in the host (blocks until all are stopped)."""
        self._owner.send(f"freeze {self.name}")

    def thaw(self) -> None:
        """SIGCONTs every process in the host."""
        self._owner.send(f"thaw {self.name}")

    def log_tails(self, lines: int = 40) -> str:
        """The last ``lines`` lines of every ``*.out``/``*.err``/``*.log`` under its ``/tmp``."""
        parts = []
        for f in sorted(self.tmp.rglob("*")):
            if f.suffix in (".out", ".err", ".log") and f.is_file():
                try:
                    text = f.read_text(errors="replace").splitlines()[-lines:]
                except OSError:
                    continue
                parts.append(f"---- {self.name}: /tmp/{f.relative_to(self.tmp)} ----")
                parts.extend(text)
        return "\n".join(parts)


class Hosts:
    """``n`` simulated hosts named ``{prefix}0..``; a context manager. Blocks until
    they are up; raises ``RuntimeError`` when ``tpuray-hosts`` fails (e.g. not root)."""

    def __init__(self, n: int, prefix: str = "host"):
        self._lines: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            [str(hosts_bin()), "--hosts", str(n), "--prefix", prefix],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        threading.Thread(target=self._read, daemon=True).start()
        first = self._next_line()
        try:
            info = json.loads(first)
        except (json.JSONDecodeError, TypeError):
            self.close()
            raise RuntimeError(f"tpuray-hosts did not start (rc={self._proc.returncode}): {first!r}")
        self.workdir = Path(info["workdir"])
        self.hosts = [Host(self, h) for h in info["hosts"]]

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _next_line(self):
        try:
            return self._lines.get(timeout=TIMEOUT)
        except queue.Empty:
            raise RuntimeError(f"tpuray-hosts gave no answer within {TIMEOUT}s") from None

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def by_name(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def send(self, command: str) -> None:
        """Sends one command line; raises :class:`HostsError` on ``err``."""
        with self._lock:
            if self._proc.poll() is not None:
                raise RuntimeError("tpuray-hosts is not running")
            self._proc.stdin.write(command + "\n")
            self._proc.stdin.flush()
            answer = self._next_line()
        if answer is None:
            raise RuntimeError(f"tpuray-hosts exited on {command!r}")
        if answer.startswith("err"):
            raise HostsError(answer[4:])
        if answer != "ok":
            raise RuntimeError(f"tpuray-hosts: unexpected answer {answer!r} to {command!r}")

    def log_tails(self, lines: int = 40) -> str:
        """:meth:`Host.log_tails` of every host."""
        return "\n".join(t for t in (h.log_tails(lines) for h in self.hosts) if t)

    def close(self) -> None:
        """Removes every host (kills their processes); idempotent."""
        proc = self._proc
        if proc.poll() is None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            print(self.log_tails())
        self.close()


def hosts_fixture(n: int, prefix: str = "host", scope: str = "function"):
    """A pytest fixture yielding ``Hosts(n, prefix)``; assign it to a module-level name."""
    import pytest

    @pytest.fixture(scope=scope)
    def _hosts():
        with Hosts(n, prefix) as hs:
            try:
                yield hs
            finally:
                # Captured by pytest: shown only when the test failed.
                print(hs.log_tails())

    return _hosts
