"""Hosts for the multi-host tests: Linux network namespaces on a bridge, each with its
own address, started processes and a link that can be cut.

The bridge lives in the root namespace with an address of its own, so the test process
(the producer, the tallies) reaches every host the way another machine on the network
would. Names carry the creating process's id (``rvh<pid hex><run letter>``), and every
network this module finds whose creator is gone is removed first: a run that crashed,
or was killed, leaves nothing behind for long. Needs root and iproute2's ``ip``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import psycopg

PREFIX = "rvh"
#: Run letters are not hex digits, so a name splits back into pid and run.
RUN_LETTERS = "ghijklmnopqrstuvwxyz"
_LINK = re.compile(rf"^{PREFIX}([0-9a-f]+)([{RUN_LETTERS}])")
_runs = count()


def unavailable() -> str | None:
    """Why these hosts cannot be built here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    return None


def _ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(name: str) -> None:
    """SIGKILL whatever still runs inside namespace ``name``, then remove it."""
    for pid in _ip("netns", "pids", name, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", name, check=False)


def remove_stale() -> list[str]:
    """Remove the namespaces and links of runs whose process is gone; their names."""
    removed: list[str] = []
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        found = _LINK.match(name)
        if found and not _alive(int(found.group(1), 16)):
            _kill_namespace(name)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        link = parts[1].strip().split("@")[0]
        found = _LINK.match(link)
        if found and not _alive(int(found.group(1), 16)):
            _ip("link", "del", link, check=False)
            removed.append(link)
    for directory in Path(tempfile.gettempdir()).glob(f"{PREFIX}-pg-*-*"):
        owner = directory.name.split("-")[2]
        if re.fullmatch("[0-9a-f]+", owner) and not _alive(int(owner, 16)):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(str(directory))
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.77.0.0/16 that no address or route of this machine touches."""
    used = _ip("-4", "addr", check=False) + _ip("-4", "route", check=False)
    taken = {int(m.group(1)) for m in re.finditer(r"\b10\.77\.(\d+)\.", used)}
    start = os.getpid() % 250
    for step in range(250):
        third = (start + step) % 250 + 1
        if third not in taken:
            return ipaddress.IPv4Network(f"10.77.{third}.0/24")
    raise RuntimeError("no free /24 left in 10.77.0.0/16")


@dataclass
class Host:
    """One namespace on the bridge: its address and the root-side end of its link."""

    name: str
    namespace: str
    address: str
    link: str

    def argv(self, command: Sequence[str]) -> list[str]:
        """``command`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *command]

    def cut(self) -> None:
        """Take the host off the network (its side sees its link up, and silence)."""
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        _ip("link", "set", self.link, "up")


class Network:
    """A bridge and the hosts on it; a context manager that removes everything."""

    def __init__(self) -> None:
        remove_stale()
        self.tag = f"{PREFIX}{os.getpid():x}{RUN_LETTERS[next(_runs) % len(RUN_LETTERS)]}"
        self.subnet = _free_subnet()
        addresses = list(self.subnet.hosts())
        self._next = iter(addresses[:-1])
        self.gateway = str(addresses[-1])
        self.bridge = f"{self.tag}b"
        self.hosts: dict[str, Host] = {}

    def __enter__(self) -> Network:
        try:
            _ip("link", "add", self.bridge, "type", "bridge", "forward_delay", "0", "stp_state", "0")
            _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, name: str) -> Host:
        index = len(self.hosts)
        host = Host(name, f"{self.tag}-{name}", str(next(self._next)), f"{self.tag}v{index}")
        self.hosts[name] = host
        _ip("netns", "add", host.namespace)
        _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
        _ip("link", "set", host.link, "master", self.bridge, "up")
        inside = ["netns", "exec", host.namespace, "ip"]
        _ip(*inside, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        _ip(*inside, "link", "set", "lo", "up")
        return host

    def close(self) -> None:
        """Kill what still runs in the hosts, remove them and the bridge (idempotent)."""
        for host in self.hosts.values():
            _kill_namespace(host.namespace)
            _ip("link", "del", host.link, check=False)
        self.hosts.clear()
        _ip("link", "del", self.bridge, check=False)


def wait_for_port(address: str, port: int, timeout: float) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _postgres_bin() -> Path:
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (candidate / "initdb").exists():
            return candidate
    found = shutil.which("initdb")
    if found is None:
        raise RuntimeError("PostgreSQL's initdb is not installed")
    return Path(found).parent


class Postgres:
    """A throwaway PostgreSQL cluster on ``host``, run as the ``postgres`` OS user,
    listening on the host's address only, trusting the hosts' subnet."""

    PORT = 5432

    def __init__(self, host: Host, subnet: ipaddress.IPv4Network) -> None:
        self.host = host
        self.dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-pg-{os.getpid():x}-"))
        shutil.chown(self.dir, "postgres", "postgres")
        self.data = self.dir / "data"
        bindir = _postgres_bin()
        initdb = ["runuser", "-u", "postgres", "--", str(bindir / "initdb"), "-D", str(self.data)]
        subprocess.run(
            [*initdb, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"], check=True, capture_output=True
        )
        with (self.data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {subnet} trust\n")
        argv = ["runuser", "-u", "postgres", "--", str(bindir / "postgres"), "-D", str(self.data)]
        for name, value in {
            "listen_addresses": host.address,
            "port": str(self.PORT),
            "unix_socket_directories": str(self.dir),
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
            "shared_buffers": "32MB",
            "logging_collector": "off",
        }.items():
            argv += ["-c", f"{name}={value}"]
        with (self.dir / "postgres.log").open("wb") as log:
            self.proc = subprocess.Popen(host.argv(argv), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for_port(host.address, self.PORT, 30)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@{self.host.address}:{self.PORT}/{database}"

    def admin(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.url().replace("+psycopg", ""), autocommit=True, connect_timeout=5)

    def log(self) -> str:
        return (self.dir / "postgres.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def hosts(*names: str) -> Iterator[tuple[Network, dict[str, Host]]]:
    """A network with one host per name; everything removed when the block ends."""
    with Network() as network:
        yield network, {name: network.add(name) for name in names}
