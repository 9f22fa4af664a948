"""The emulated slow link (`--link`): rates, the privilege check, real shaping and teardown on every exit path.

Tests that build namespaces need root and `ip`/`tc`; they are skipped elsewhere. The refusal without the
privilege is tested everywhere by forcing the check to fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import planner.platform.link as link_mod
from planner.commands.cli import main
from planner.contracts.fingerprint import ClusterInfo
from planner.platform.launch import run_distributed
from planner.platform.link import (
    LINK_ENV,
    EmulatedLink,
    LinkError,
    LinkUnavailableError,
    list_namespaces,
    parse_rate,
    privilege_problem,
)
from planner.types import DistributedError

pytestmark = pytest.mark.spawns  # its tests start their own workers (tests/pool.py says which must)

needs_root = pytest.mark.skipif(privilege_problem() is not None, reason=f"no emulated link here: {privilege_problem()}")
PLAN = Path(__file__).resolve().parents[1] / "plans" / "lstm-2w-dense.json"


def _ours(pid: int | None = None) -> list[str]:
    """Namespaces and hosts files this module's links made for launcher `pid` (default: this process)."""
    prefix = f"{link_mod.NAMESPACE_PREFIX}-{pid or os.getpid()}-"
    hosts_files = [p.name for p in Path(tempfile.gettempdir()).glob(f"{prefix}*.hosts")]
    return _namespaces(pid) + hosts_files


def _namespaces(pid: int | None = None) -> list[str]:
    prefix = f"{link_mod.NAMESPACE_PREFIX}-{pid or os.getpid()}-"
    return [n for n in list_namespaces() if n.startswith(prefix)]


# -- rates -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "bits"), [("1gbit", 10**9), ("200mbit", 2 * 10**8), ("10Gbit", 10**10),
                                            ("2.5gbit", 2_500_000_000), ("1500kbit", 1_500_000)])
def test_rates_parse_in_tc_units(text: str, bits: int) -> None:
    rate = parse_rate(text)
    assert rate.bits_per_s == bits and rate.bytes_per_s == bits / 8
    assert parse_rate(rate.text) == rate


@pytest.mark.parametrize("text", ["fast", "0gbit", "-1mbit", "1 gigabit", "", "1gbps", "500kbit", "0.0001gbit"])
def test_malformed_rates_are_refused(text: str) -> None:
    with pytest.raises(LinkError, match="--link"):
        parse_rate(text)


@pytest.mark.parametrize("text", ["fast", "0gbit", "-1mbit"])
@pytest.mark.parametrize("command", ["profile", "bench", "tune", "retune", "demo"])
def test_malformed_link_on_the_command_line_is_one_line_and_exit_2(
    command: str, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = {
        "profile": ["profile", "-o", "x.json"],
        "bench": ["bench", "--plan", str(PLAN)],
        "tune": ["tune", "profile.json", "-o", "x.json"],
        "retune": ["retune", str(PLAN)],
        "demo": ["demo"],
    }[command]
    try:
        status = main([*argv, f"--link={text}"])
    except SystemExit as exc:  # argparse's own refusal
        status = exc.code
    assert status == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "--link" in errors[0] and text in errors[0]
    assert "must" in errors[0], errors[0]  # the rate was refused, not the option


# -- the privilege ------------------------------------------------------------------------------------

def test_without_the_privilege_the_command_says_so_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(link_mod, "privilege_problem", lambda: "it needs root (forced by the test)")
    assert main(["bench", "--plan", str(PLAN), "--link", "1gbit", "--steps", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("planner")]
    assert err == ["planner bench: error: cannot emulate a 1gbit link: it needs root (forced by the test); "
                   "run without --link"]
    assert _ours() == []
    with pytest.raises(LinkUnavailableError), EmulatedLink(parse_rate("1gbit"), 2):
        pass


def test_demo_falls_back_to_loopback_without_the_privilege(monkeypatch: pytest.MonkeyPatch) -> None:
    from planner.commands.demo import DemoCommand

    monkeypatch.setattr(link_mod, "privilege_problem", lambda: "forced by the test")
    assert DemoCommand._demo_link("1gbit") is None
    assert DemoCommand._demo_link("none") is None
    assert DemoCommand._demo_link("200mbit") == parse_rate("200mbit")  # asked for explicitly: no fallback


def test_the_privilege_check_names_missing_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link_mod.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    assert privilege_problem() == "tc not found (install iproute2)"
    monkeypatch.setattr(link_mod.shutil, "which", lambda tool: "/usr/sbin/" + tool)
    monkeypatch.setattr(link_mod, "_capabilities", lambda: 0)
    assert "root" in (privilege_problem() or "")


def test_a_shaping_command_that_fails_tears_down_what_was_made(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[str, ...]] = []
    real_run = link_mod._run

    def failing_tc(*cmd: str) -> None:
        if cmd[0] == "tc":
            raise LinkError(f"`{' '.join(cmd)}` failed: forced by the test")
        made.append(cmd)
        real_run(*cmd)

    if privilege_problem() is not None:
        pytest.skip("needs root to make the namespaces that must then be removed")
    monkeypatch.setattr(link_mod, "_run", failing_tc)
    with pytest.raises(LinkError, match="forced by the test"), EmulatedLink(parse_rate("1gbit"), 2):
        pass
    assert made and _ours() == []


# -- provenance ---------------------------------------------------------------------------------------

def test_cluster_info_carries_the_link_and_old_documents_load() -> None:
    info = ClusterInfo(world_size=2, backend="gloo", device="cpu", link="1gbit")
    assert ClusterInfo.from_dict(info.to_dict()) == info
    assert "1gbit" in info.describe()
    old = {"world_size": 2, "backend": "gloo", "device": "cpu", "host_count": 1}
    assert ClusterInfo.from_dict(old).link is None


# -- real namespaces ----------------------------------------------------------------------------------

def _allreduce_seconds(rank: int, world_size: int, numel: int) -> tuple[float, str | None, str | None]:
    x = torch.ones(numel)
    dist.all_reduce(x)  # connections are set up lazily: not timed
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    assert torch.all(x == world_size**4)
    return sorted(times)[1], os.environ.get(LINK_ENV), os.environ.get("GLOO_SOCKET_IFNAME")


@needs_root
def test_the_link_limits_bandwidth_and_leaves_nothing_behind() -> None:
    numel = 8 << 20  # 32 MiB: at 1 Gbit/s about 0.27 s per allreduce on 2 workers
    loopback = run_distributed(_allreduce_seconds, 2, numel)
    shaped = run_distributed(_allreduce_seconds, 2, numel, link=parse_rate("1gbit"))
    assert all(r[1] is None for r in loopback)
    assert all(r[1:] == ("1gbit", "eth0") for r in shaped)
    # The slowest rank's time: a 1 Gbit/s link moves 32 MiB each way in 0.27 s at best.
    slow, fast = max(r[0] for r in shaped), max(r[0] for r in loopback)
    assert slow >= 0.25, f"a 32 MiB allreduce took {slow:.3f} s behind a 1gbit link"
    assert slow >= 3 * fast, f"behind 1gbit {slow:.3f} s, loopback {fast:.3f} s"
    assert _ours() == []


@needs_root
def test_three_workers_share_a_bridge() -> None:
    results = run_distributed(_allreduce_seconds, 3, 1 << 16, link=parse_rate("200mbit"))
    assert [r[1] for r in results] == ["200mbit"] * 3
    assert _ours() == []


def _rank1_dies(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@needs_root
def test_a_killed_worker_leaves_nothing_behind() -> None:
    """And it is named as the cause, whenever its peer's broken connection was noticed."""
    with pytest.raises(DistributedError, match=r"^worker rank 1 was killed by SIGKILL") as caught:
        run_distributed(_rank1_dies, 2, timeout=30, link=parse_rate("1gbit"))
    assert "out of memory" not in str(caught.value)  # killed by hand, not by the kernel's OOM killer
    assert _ours() == []


def _peer_names(rank: int, world_size: int) -> list[str]:
    import socket

    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", ifname], capture_output=True, text=True).stdout
    mine = out.split(" inet ")[1].split("/")[0]  # this worker's address on the link, 169.254.S.(rank + 1)
    peer = f"{mine.rsplit('.', 1)[0]}.{2 - rank}"
    return [socket.getnameinfo((address, 0, 0, 0) if ":" in address else (address, 0), socket.NI_NAMEREQD)[0]
            for address in (peer, f"::ffff:{peer}")]


@needs_root
def test_peers_behind_the_link_have_names_so_c10d_does_not_warn() -> None:
    """c10d looks up the name of every peer that connects to its store, at the IPv4-mapped address; inside the
    namespaces no DNS answers, so each run printed "hostname of the client socket cannot be retrieved"."""
    names = run_distributed(_peer_names, 2, timeout=60, link=parse_rate("1gbit"))
    assert [n[0] for n in names] == [n[1] for n in names]
    assert names[0][0].endswith("-w1") and names[1][0].endswith("-w0")
    with open("/etc/hosts") as f:
        assert "169.254." not in f.read()  # the machine's own file is untouched
    assert _ours() == []


@needs_root
def test_stale_namespaces_of_dead_runs_are_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{link_mod.NAMESPACE_PREFIX}-{dead.pid}-abcdef-hub"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with EmulatedLink(parse_rate("1gbit"), 1) as net:
            assert stale not in list_namespaces()
            assert net.hub in list_namespaces()
        assert _ours() == []
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True, check=False)


SLEEPER = textwrap.dedent("""
    import faulthandler, signal, sys, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it is, should it hang
    # Ctrl-C raises KeyboardInterrupt, as under `planner` (whose main says so): a test run started in the background
    # passes SIGINT on ignored, and Python then leaves it ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from planner.platform.launch import run_distributed
    from planner.platform.link import parse_rate
    from tests.test_link import sleep_forever

    run_distributed(sleep_forever, 2, timeout=120, link=parse_rate("1gbit"))
""")


def sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(120)


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_tear_the_link_down(sig: signal.Signals) -> None:
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while len(_namespaces(proc.pid)) < 3 and time.monotonic() < deadline:  # hub and two workers
            time.sleep(0.2)
        made = len(_namespaces(proc.pid))
        assert made == 3, proc.stderr.read().decode() if proc.poll() is not None else "no link yet"
        time.sleep(1.0)  # the workers have started
        proc.send_signal(sig)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # its stacks, then kill it
            time.sleep(2)
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"the launcher did not exit within 60 s of {sig.name}; its stacks:\n{err.decode()[-4000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert _ours(proc.pid) == []


@pytest.mark.parametrize("text", ["1" + "0" * 400 + "gbit", "1" + "0" * 310 + "kbit", "11tbit"])
def test_absurd_rates_are_refused_in_one_line(text: str) -> None:
    with pytest.raises(LinkError, match=r"--link <= 10tbit") as caught:
        parse_rate(text)
    assert len(str(caught.value)) < 200  # the rate is shortened in the message, not printed whole
    assert parse_rate("10tbit").bits_per_s == 10**13
