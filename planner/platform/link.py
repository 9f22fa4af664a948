"""Emulating a slower network on one machine: local workers in network namespaces behind a shaped link.

Over loopback, workers on one machine exchange gradients far faster than GPUs on Ethernet do, so every
run is compute-bound and planning looks pointless. `EmulatedLink` gives each emulated host its own
network namespace (by default one host per worker; with `hosts=H`, world_size / H consecutive ranks per
host) and joins them through a bridge:

    namespace <prefix>-hub:   bridge br0 ── w0, w1, ... (one veth end per host)
    namespace <prefix>-w<h>:  eth0 (the other veth end), address 169.254.<net>.<h+1>/24, lo

Each host's egress (its `eth0`) is shaped by a token bucket filter to the given rate
(`tc qdisc add dev eth0 root tbf rate RATE burst B latency 50ms`), so no host can send faster
than RATE; the workers of one host share that rate, as they share a real host's network card, and
reach each other over the namespace's loopback at memory speed. Each host also has its own host name
(the namespace's name; a UTS namespace per worker), so the workers see H machines. Addresses are IPv4
link-local: nothing outside these namespaces routes to them, and nothing is created in the machine's own
namespace.

With `--intra-link RATE` (a `LinkRate.intra`), each host's loopback is shaped the same way, so the workers
of one host share that rate among them (a host's bus, slower than memory but faster than the network).

Limits: bandwidth only. The kernel here has no `netem`, so no propagation delay or loss is added;
a tbf queue adds some delay of its own under load, no more. The token bucket holds 2 ms of traffic
(at least 64 KiB), so after an idle moment that much passes at loopback speed. The rate caps each host's egress, which
is what a real NIC does, but both directions of all workers share one machine's CPU.

The launcher (`planner.platform.launch.run_distributed(..., link=...)`) creates the namespaces, moves each
spawned worker into its own (`enter_namespace`, a `setns(2)` before the process group is made), tells
gloo which interface to use (`GLOO_SOCKET_IFNAME`) and tears everything down on every exit path: a
normal return, an error, Ctrl-C or SIGTERM, a killed worker. Names carry the launcher's pid and a
random token, so runs at the same time do not collide; namespaces left by a run that was itself
killed (SIGKILL leaves no chance to clean) are removed by the next run, once their pid is gone.

It needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the `ip` and `tc` programs; without them
`LinkUnavailableError` says so in one line. Nothing else in the project needs root.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from planner.platform.cleanup import ExitOnSignals, pid_alive
from planner.types import PlannerError

__all__ = [
    "HOSTS_ENV",
    "LINK_ENV",
    "NAMESPACE_PREFIX",
    "EmulatedLink",
    "LinkError",
    "LinkRate",
    "LinkUnavailableError",
    "current_link",
    "enter_namespace",
    "parse_rate",
    "recorded_link",
    "remove_stale_namespaces",
]

#: Set in every worker started behind an emulated link (its rate, e.g. "1gbit"), so what the worker
#: measures can record the link it ran on (profiles and probes carry it in their cluster provenance).
LINK_ENV = "PLANNER_LINK"

#: Set in every worker started on emulated hosts (`hosts=`): how many (profiles record it as `host_count`).
HOSTS_ENV = "PLANNER_HOSTS"

#: Every namespace this module creates is named `planner-<pid>-<token>-<role>`.
NAMESPACE_PREFIX = "planner"

#: The interface name inside each worker's namespace (what GLOO_SOCKET_IFNAME names).
WORKER_IFNAME = "eth0"

_UNITS = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(kbit|mbit|gbit|tbit)\s*$", re.IGNORECASE)
_NAME_RE = re.compile(rf"^{NAMESPACE_PREFIX}-(\d+)-([0-9a-f]+)-(hub|w\d+)$")
_HOSTS_RE = re.compile(rf"^{NAMESPACE_PREFIX}-(\d+)-([0-9a-f]+)-.*\.hosts$")
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
#: Below this a link is too slow for gradient traffic to finish within any reasonable timeout.
_MIN_RATE = 10**6
_MAX_RATE = 10**13  # 10tbit


class LinkError(PlannerError, RuntimeError):
    """The emulated link could not be set up (a command failed) or a rate is malformed."""


class LinkUnavailableError(LinkError):
    """This process lacks what an emulated link needs: root (CAP_NET_ADMIN, CAP_SYS_ADMIN), `ip`, `tc`."""


@dataclass(frozen=True)
class LinkRate:
    """A link rate in bits per second, and the text the user gave; with emulated hosts, `intra` the rate of
    the loopback inside each host (`--intra-link`), None for unshaped."""

    bits_per_s: int
    text: str
    intra: LinkRate | None = None

    @property
    def bytes_per_s(self) -> float:
        return self.bits_per_s / 8

    @property
    def label(self) -> str:
        """How profiles and plans record it: "1gbit", or "1gbit (10gbit inside hosts)"."""
        return self.text + (f" ({self.intra.text} inside hosts)" if self.intra is not None else "")


def recorded_link(label: str | None) -> LinkRate | None:
    """The link a profile or plan recorded (`LinkRate.label`: "1gbit", "1gbit (10gbit inside hosts)"), to run on it
    again; None for loopback (no label)."""
    if not label:
        return None
    outer, _, inner = label.partition(" (")
    rate = parse_rate(outer)
    return rate if not inner else replace(rate, intra=parse_rate(inner.removesuffix(" inside hosts)")))


def parse_rate(text: str) -> LinkRate:
    """`1gbit`, `200mbit`, `10gbit`, `2.5gbit`, `1500kbit` (tc's units, decimal: 1gbit = 10^9 bit/s), >= 1mbit."""
    m = _RATE_RE.match(text)
    if m is None:
        raise LinkError(f"--link must be a rate such as 1gbit, 200mbit or 10gbit, but got {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]  # inf for a number of hundreds of digits
    if not value <= _MAX_RATE:
        raise LinkError(f"`--link <= 10tbit` must hold (a faster link is no slower than this machine's loopback), "
                        f"but got {text[:40]!r}{'...' if len(text) > 40 else ''}")
    bits = round(value)
    if bits < _MIN_RATE:
        raise LinkError(f"`--link >= 1mbit` must hold (slower links make every collective time out), but got {text!r}")
    return LinkRate(bits_per_s=bits, text=f"{m.group(1)}{m.group(2).lower()}")


def current_link() -> str | None:
    """The emulated link this worker runs behind ("1gbit"), or None (loopback, or a real network)."""
    return os.environ.get(LINK_ENV) or None


def _capabilities() -> int:
    """The effective capability set of this process (0 when /proc does not say)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def privilege_problem() -> str | None:
    """Why an emulated link cannot be made here, or None when it can (the first check that fails)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (install iproute2)"
    caps = _capabilities()
    cap_net_admin, cap_sys_admin = 1 << 12, 1 << 21
    if not (caps & cap_net_admin and caps & cap_sys_admin):
        return "it needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces"
    return None


def _run(*cmd: str) -> None:
    """Run one `ip`/`tc` command; a failure becomes a LinkError naming the command and its message."""
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise LinkError(f"`{' '.join(cmd)}` failed: {detail[-1] if detail else f'exit {proc.returncode}'}")


def list_namespaces() -> list[str]:
    """Names of the network namespaces `ip netns` knows."""
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces this module made for runs whose launcher no longer exists; return their names."""
    removed = []
    for name in list_namespaces():
        m = _NAME_RE.match(name)
        if m and not pid_alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
            removed.append(name)
    for path in Path(tempfile.gettempdir()).glob(f"{NAMESPACE_PREFIX}-*.hosts"):  # see EmulatedLink.hosts_file
        m = _HOSTS_RE.match(path.name)
        if m and not pid_alive(int(m.group(1))):
            with contextlib.suppress(OSError):
                path.unlink()
    return removed


def _burst_bytes(rate: LinkRate) -> int:
    """tbf's bucket: 2 ms worth of bytes at the rate, at least 64 KiB. A smaller bucket starves the shaper
    between timer ticks: at 1gbit, 64 KiB let large allreduces reach only about 0.64 of the rate here,
    256 KiB (2 ms) about 0.95. The cost: after an idle moment, the first bucketful passes unshaped."""
    return max(64 << 10, int(rate.bytes_per_s * 2e-3))


class EmulatedLink:
    """Network namespaces for `hosts` emulated hosts of `world_size` local workers joined by a bridge, each
    host's egress shaped to `rate` (None: not shaped, hosts apart but at veth speed).

    Use as a context manager (or `create()` / `destroy()`); `destroy` is safe to call more than once.
    While it is active, SIGTERM and SIGHUP raise `SystemExit` in the main thread so `with` blocks unwind
    and the namespaces are deleted.

    Args:
        rate: the per-host egress rate, or None.
        world_size: number of workers (>= 1).
        hosts: number of emulated hosts, dividing world_size (default: one per worker).

    Raises:
        LinkError: `hosts` does not divide `world_size`.
    """

    def __init__(self, rate: LinkRate | None, world_size: int, hosts: int | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"`world_size >= 1` must hold, but got world_size={world_size}")
        hosts = world_size if hosts is None else hosts
        if hosts < 1 or world_size % hosts:
            raise LinkError(f"--hosts must divide the number of workers ({world_size}) into equal hosts, but got "
                            f"{hosts}: pick one of {[h for h in range(1, world_size + 1) if world_size % h == 0]}")
        self.rate = rate
        self.world_size = world_size
        self.hosts = hosts
        self.prefix = f"{NAMESPACE_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        # One /24 of 169.254.0.0/16 per run (link-local: never routed); namespaces keep runs apart anyway.
        self.subnet = 1 + secrets.randbelow(250)
        self.created: list[str] = []
        #: A copy of /etc/hosts that also names every host's address, bound over /etc/hosts in the workers
        #: (see `enter_namespace`): c10d looks up the host name of each peer that connects, and inside the
        #: namespaces no DNS server answers, so without it every run printed c10d's "hostname of the client
        #: socket cannot be retrieved" once per peer.
        self.hosts_file: str | None = None
        self._signals = ExitOnSignals()

    # -- names ------------------------------------------------------------------------------------
    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    @property
    def per_host(self) -> int:
        """Workers in each emulated host."""
        return self.world_size // self.hosts

    def host_of(self, rank: int) -> int:
        """The emulated host of worker `rank`: ranks 0 .. per_host - 1 on host 0, and so on (as torchrun's
        multi-node launch numbers them)."""
        return rank // self.per_host

    def namespace(self, rank: int) -> str:
        """The network namespace of worker `rank`'s host; its name is also that host's name."""
        return self._host_namespace(self.host_of(rank))

    def _host_namespace(self, host: int) -> str:
        return f"{self.prefix}-w{host}"

    def namespace_path(self, rank: int) -> str:
        """The file `setns(2)` opens to join worker `rank`'s namespace."""
        return f"/var/run/netns/{self.namespace(rank)}"

    def address(self, rank: int) -> str:
        """The address of worker `rank`'s host (workers of one host share it and talk over its loopback)."""
        return f"169.254.{self.subnet}.{self.host_of(rank) + 1}"

    @property
    def ifname(self) -> str:
        return WORKER_IFNAME

    # -- life cycle -------------------------------------------------------------------------------
    def create(self) -> EmulatedLink:
        """Check the privilege, clear stale namespaces, build the namespaces, bridge and shapers."""
        problem = privilege_problem()
        if problem is not None:
            what, drop = ((f"a {self.rate.text} link", "--link") if self.rate is not None
                          else (f"{self.hosts} hosts", "--hosts"))
            raise LinkUnavailableError(f"cannot emulate {what}: {problem}; run without {drop}")
        self._signals.arm()
        try:
            remove_stale_namespaces()
            self._add_namespace(self.hub)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
            for host in range(self.hosts):
                self._add_host(host)
            self._write_hosts_file()
        except BaseException:
            self.destroy()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.created.append(name)

    def _add_host(self, host: int) -> None:
        ns, port = self._host_namespace(host), f"w{host}"
        self._add_namespace(ns)
        _run("ip", "-n", ns, "link", "add", WORKER_IFNAME, "type", "veth", "peer", "name", port, "netns", self.hub)
        _run("ip", "-n", self.hub, "link", "set", port, "master", "br0")
        _run("ip", "-n", self.hub, "link", "set", port, "up")
        _run("ip", "-n", ns, "addr", "add", f"{self.address(host * self.per_host)}/24", "dev", WORKER_IFNAME)
        _run("ip", "-n", ns, "link", "set", WORKER_IFNAME, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        if self.rate is not None:
            _run("tc", "-n", ns, "qdisc", "add", "dev", WORKER_IFNAME, "root", "tbf",
                 "rate", f"{self.rate.bits_per_s}bit", "burst", str(_burst_bytes(self.rate)), "latency", "50ms")
        if self.rate is not None and self.rate.intra is not None:
            # Inside the host: its workers reach each other over this namespace's loopback, one device for every
            # flow, as they would share a host's bus. Loopback packets are up to 64 KiB: the bucket holds several.
            intra = self.rate.intra
            _run("tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{intra.bits_per_s}bit",
                 "burst", str(max(256 << 10, _burst_bytes(intra))), "latency", "50ms")

    def _write_hosts_file(self) -> None:
        try:
            with open("/etc/hosts", encoding="utf-8", errors="replace") as f:
                system = f.read()
        except OSError:
            system = "127.0.0.1 localhost\n"
        # c10d's store listens on IPv6 and sees its peers at IPv4-mapped addresses (::ffff:a.b.c.d)
        firsts = range(0, self.world_size, self.per_host)  # one rank of each host
        names = "".join(f"{self.address(r)} {self.namespace(r)}\n::ffff:{self.address(r)} {self.namespace(r)}\n"
                        for r in firsts)
        if not re.search(r"^\s*::1\s", system, re.MULTILINE):
            names += "::1 localhost\n"
        fd, path = tempfile.mkstemp(prefix=f"{self.prefix}-", suffix=".hosts")
        self.hosts_file = path
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(system.rstrip("\n") + "\n" + names)

    def destroy(self) -> None:
        """Delete every namespace this link created (their veth pairs and the bridge go with them)."""
        while self.created:
            name = self.created.pop()
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
        if self.hosts_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.hosts_file)
            self.hosts_file = None
        self._signals.disarm()

    def __enter__(self) -> EmulatedLink:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def enter_namespace(path: str, hosts_file: str | None = None, hostname: str | None = None) -> None:
    """Move the calling thread (call it first thing in a fresh worker process) into the network
    namespace at `path`; threads it starts afterwards inherit it.

    With `hostname`, the process also takes a UTS namespace of its own named so (`socket.gethostname()`
    then says which emulated host it is on, as on real hosts). With `hosts_file`, it takes a mount namespace
    of its own in which that file is bound over /etc/hosts (what `ip netns exec` does with
    /etc/netns/NAME/hosts), so peers' addresses have names. That is only for quiet logs: where it cannot be
    done, the worker goes on without it.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise LinkError(f"cannot join network namespace {path}: {os.strerror(err)}")
    finally:
        os.close(fd)
    if hostname is not None:
        name = hostname.encode()
        if libc.unshare(_CLONE_NEWUTS) != 0 or libc.sethostname(name, len(name)) != 0:
            err = ctypes.get_errno()
            raise LinkError(f"cannot name this worker's emulated host {hostname!r}: {os.strerror(err)}")
    # private first, so the bind mount never propagates back to the machine's own mount namespace
    if (hosts_file is not None and libc.unshare(_CLONE_NEWNS) == 0
            and libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) == 0):
        libc.mount(os.fsencode(hosts_file), b"/etc/hosts", None, _MS_BIND, None)
