"""Run a function in N real processes joined by a process group (gloo by default) on 127.0.0.1.

Used by `planner profile`, `planner bench` and the distributed tests to run small multi-process jobs
without `torchrun`. Each worker is a fresh "spawn" process (so `fn` must be importable: a module-level
function), runs `fn(rank, world_size, *args)`, and sends back its (picklable) return value or its
exception. A worker that hangs past `timeout` gets every worker killed and the call fails; with no `timeout`
(the commands' jobs, which take as long as their work: hours for a trial on a CPU) the call waits for them, and a
worker left waiting in a collective for `COLLECTIVE_TIMEOUT_S` fails instead, and with it the call.

With `link=` (a `planner.platform.link.LinkRate`) the workers run behind an emulated slower network instead of
loopback: each in its own network namespace, its egress shaped to the rate (see `planner.platform.link`); the
namespaces are torn down when the call returns or fails. With `slowdown=` (a
`planner.platform.slowdown.Slowdown`) the named workers run under a CPU quota that makes them that many times
slower (see `planner.platform.slowdown`); the cgroups are removed when the call returns or fails.

The workers' lives are bound to the launcher's: each asks the kernel to kill it when the launcher dies (on
Linux `prctl(PR_SET_PDEATHSIG)`, elsewhere a thread watching its parent pid), so a launcher killed with
SIGKILL (by a job scheduler, the OOM killer) leaves no worker computing; one still starting then (importing torch
takes seconds) exits once its interpreter is up, before it runs anything. Ctrl-C is the launcher's alone: the
workers start with SIGINT blocked and then ignore it, so one pressed while a worker's interpreter starts cannot
kill it halfway ("Fatal Python error: init_import_site"); the launcher, interrupted, kills them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import planner.platform.collective_defaults  # noqa: F401  (before the workers' process group: see there)
from planner._lifeline import LAUNCHER_ENV, die_with
from planner.platform.link import HOSTS_ENV, LINK_ENV, EmulatedLink, LinkError, LinkRate, enter_namespace
from planner.platform.memory import steady_allocator
from planner.platform.oom import OomWatch
from planner.platform.phase import PHASE_BYTES, read_phase
from planner.platform.phase import attach as attach_phase
from planner.platform.slowdown import Slowdown, SlowdownError, ThrottledWorkers, WorkerThrottle, enter_cgroup
from planner.types import DistributedError, PlannerError, RemoteTraceback

__all__ = [
    "RemoteTraceback",
    "broadcast_json",
    "check_gpus",
    "device_for",
    "free_port",
    "resolve_backend",
    "run_distributed",
    "run_job",
    "run_jobs",
    "under_torchrun",
]

#: After one worker fails, how long the others get to finish before they are killed (they are likely
#: blocked in a collective that will never complete).
FAILURE_GRACE_S = 5.0
#: With no overall `timeout`, how long a collective waits for its peers before it fails: a rank that hangs (or
#: works this long alone between two collectives, which no command does) fails the job. The commands' collectives
#: had this timeout when their jobs also had it as a deadline.
COLLECTIVE_TIMEOUT_S = 3600.0


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise PlannerError(f"unknown backend {backend!r}: use gloo, nccl or auto")
    if backend == "nccl" and not torch.cuda.is_available():
        raise PlannerError("backend nccl needs CUDA, and no GPU is visible: use --backend gloo")
    return backend


def check_gpus(backend: str, workers: int, fix: str | None = None) -> None:
    """Refuse to start more nccl workers than there are GPUs: NCCL fails on two ranks of one communicator
    sharing a GPU, with a message that does not say so. `fix`: what the user can do (default: the flags)."""
    if backend != "nccl":
        return
    gpus = torch.cuda.device_count()
    if workers > gpus:
        fix = fix or f"use --nproc {gpus} or fewer, or --backend gloo"
        raise DistributedError(f"backend nccl needs a GPU per worker, and {workers} workers would share {gpus} "
                               f"GPU{'s' if gpus != 1 else ''}: {fix}")


def _gpu_of(backend: str, index: int) -> torch.device | None:
    """The GPU a worker of `backend` binds its process group to (made current), or None off nccl. Bound, the
    group knows its device from the start: no guessing it from the rank, no warning at every barrier."""
    if backend != "nccl":
        return None
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def device_for(backend: str) -> torch.device:
    """The device this rank computes on: its GPU for nccl (LOCAL_RANK under torchrun), else the CPU."""
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class _Network:
    """Where a worker behind an emulated link lives: its namespace, the rendezvous address, the link."""

    namespace_path: str
    master_addr: str
    ifname: str
    rate: str | None
    hosts_file: str | None = None
    hostname: str | None = None
    hosts: int | None = None


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout: float,
    args: tuple[Any, ...],
    conn: Connection,
    network: _Network | None = None,
    throttle: WorkerThrottle | None = None,
    launcher: int | None = None,
    phase: Any = None,
) -> None:
    """Body of one spawned worker: join the group, run `fn`, send its outcome, leave the group.

    The outcome is ("ok", value) or ("error", exception, traceback text, wall time of the failure). It
    is sent before the group is destroyed, so a worker's own error reaches the parent before its peers
    fail on the vanished group; the parent reports the earliest failure.

    `launcher`: the pid of the process that started it, with which it dies. `phase`: the shared buffer where it
    names its phase (`planner.platform.phase`).
    """
    if phase is not None:
        attach_phase(phase)
    _leave_interrupts_to_the_launcher()
    if launcher is not None:
        die_with(launcher)  # armed already as the package was imported (LAUNCHER_ENV); here where it was not
    torch.set_num_threads(1)
    steady_allocator()
    gc.freeze()  # what the worker imported lives as long as it: its garbage collections skip it (`collect_garbage`)
    joined = False
    message: tuple[Any, ...]
    master_addr = "127.0.0.1"
    try:
        if network is not None:
            enter_namespace(network.namespace_path, network.hosts_file, network.hostname)
            os.environ["GLOO_SOCKET_IFNAME"] = network.ifname
            if network.rate is not None:
                os.environ[LINK_ENV] = network.rate
            if network.hosts is not None:
                os.environ[HOSTS_ENV] = str(network.hosts)
            master_addr = network.master_addr
        gpu = _gpu_of(backend, rank % max(1, torch.cuda.device_count()))
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
            device_id=gpu,
        )
        joined = True
        if throttle is not None:  # this thread only: the group's communication threads keep full speed
            enter_cgroup(throttle, thread_only=True)
        message = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:
        message = ("error", exc, traceback.format_exc(), time.time())
    # Plain pickle, not the Connection's own (multiprocessing's ForkingPickler, through which torch shares a
    # tensor's storage as a file descriptor that the parent fetches from this process later): the worker may
    # have exited by the time a busy parent reads, and the parent must still get every byte of the result.
    try:
        payload = pickle.dumps(message)
    except Exception as exc:  # the value or the exception did not pickle
        text = message[2] if len(message) == 4 else ""
        payload = pickle.dumps(("error", None, f"{text}could not send the worker's result to the parent: {exc!r}\n",
                                time.time()))
    try:
        conn.send_bytes(payload)
    finally:
        conn.close()
        if joined:
            _leave_group()


def _leave_interrupts_to_the_launcher() -> None:
    """Ignore SIGINT from now on, then unblock it (the launcher started this worker with it blocked): a Ctrl-C
    reaches every process of the terminal's group, and the launcher alone answers it, killing the workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _leave_group() -> None:
    """Destroy the process group, after collecting the garbage that still holds it: objects in reference
    cycles (a DDP model and its hooks, an exchange's pending work) otherwise live until the interpreter shuts
    down, and gloo's threads then abort the process ("terminate called without an active exception"). Everything
    frozen since the worker started (`planner.platform.memory.collect_garbage`) is unfrozen first, so that a cycle
    frozen while alive and dropped since is collected too."""
    gc.unfreeze()
    gc.collect()
    dist.destroy_process_group()


def _raise_worker_error(rank: int, exc: BaseException | None, text: str, phase: str = "") -> None:
    """Re-raise a worker's exception in the parent, its traceback text attached as the cause; a worker that
    left no exception (it died, or its exception did not pickle) is a DistributedError saying what is known,
    and the phase it was in (`phase`, where it named one)."""
    remote = RemoteTraceback(f"worker rank {rank} failed:\n{text}", rank, phase=phase or None)
    if exc is None:
        last = text.strip().splitlines()[-1] if text.strip() else "no result and no traceback"
        raise DistributedError(f"worker rank {rank} {last}{_during(phase)}") from remote
    raise exc from remote


def _during(phase: str) -> str:
    return f" (during: {phase})" if phase else ""


def _death(proc: Any, oom: OomWatch | None = None) -> str:
    """How a worker that sent nothing ended, as the end of "worker rank N ...". A SIGKILL is called out of memory
    only when `oom` says the kernel's OOM killer did it: users and job schedulers send SIGKILL too."""
    code = proc.exitcode
    if code is None or code >= 0:
        return f"exited with code {code} without a result"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if -code != signal.SIGKILL or oom is None:
        return f"was killed by {name}"
    match oom.killed(proc.pid):
        case True:
            return (f"was killed by {name}: out of memory (the kernel's OOM killer): use a smaller --batch-size or "
                    "fewer workers")
        case False:
            return f"was killed by {name}"
        case None:
            return f"was killed by {name} (whether by the kernel's OOM killer is not readable here: `dmesg` says)"


def _check_picklable(fn: Callable[..., Any]) -> None:
    """ValueError unless `fn` pickles by name (spawned workers import it)."""
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(f"fn must be a module-level function so spawned workers can import it: {exc}") from None


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = 120,
    backend: str = "gloo",
    link: LinkRate | None = None,
    slowdown: Slowdown | None = None,
    hosts: int | None = None,
    collective_timeout: float | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned processes, return results by rank.

    Args:
        fn: a module-level function (it is pickled by name into each worker).
        world_size: number of processes.
        *args: picklable arguments passed to every worker.
        timeout: seconds after which a worker that has not finished is killed with all the others;
            also the process group's collective timeout. None: no deadline (the collective timeout is
            `COLLECTIVE_TIMEOUT_S`).
        collective_timeout: the process group's collective timeout when it is to differ from `timeout` (a job
            with no deadline whose collectives should still not wait an hour).
        backend: "gloo" (default) or "nccl" (each rank then uses GPU `rank % device_count`).
        link: run the workers behind an emulated link of this rate (`planner.platform.link`; needs root, else
            `LinkUnavailableError`), torn down before the call returns or raises.
        slowdown: run the named workers under a CPU quota, that many times slower (`planner.platform.slowdown`;
            needs root, else `SlowdownUnavailableError`), the groups removed before the call returns or raises.
        hosts: spread the workers over this many emulated hosts (`planner.platform.link`: a network namespace
            and host name each, the link between them shaped to `link` when given; needs root), ranks
            0 .. world_size / hosts - 1 on the first. Workers see it as `PLANNER_HOSTS`.

    Returns:
        The return values of `fn`, indexed by rank.

    Raises:
        The first failing worker's exception (its traceback text as `__cause__`), or `DistributedError`
        if a worker died without a result, its exception did not pickle, or a worker hung past `timeout`.
    """
    if world_size < 1:
        raise ValueError(f"`world_size >= 1` must hold, but got world_size={world_size}")
    _check_picklable(fn)
    with contextlib.ExitStack() as stack:
        networks: list[_Network | None] = [None] * world_size
        throttles: list[WorkerThrottle | None] = [None] * world_size
        if slowdown is not None and slowdown.factors:
            groups = stack.enter_context(ThrottledWorkers(slowdown, world_size))
            throttles = [groups.throttle(r) for r in range(world_size)]
        if link is not None or hosts is not None:
            networks = _emulated_networks(stack, link, world_size, hosts)
        return _spawn(fn, world_size, args, timeout, backend, networks, throttles, collective_timeout)


def _emulated_networks(stack: contextlib.ExitStack, link: LinkRate | None, workers: int,
                       hosts: int | None) -> list[_Network | None]:
    """Build the emulated link and hosts for `workers` ranks (torn down when `stack` closes): each rank's
    namespace, address and host name."""
    net = stack.enter_context(EmulatedLink(link, workers, hosts))
    return [_Network(net.namespace_path(r), net.address(0), net.ifname, None if link is None else link.label,
                     net.hosts_file, hostname=None if hosts is None else net.namespace(r), hosts=hosts)
            for r in range(workers)]


def under_torchrun() -> bool:
    """Whether this process is one rank of a job torchrun (or another launcher setting its variables) started."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def run_job(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float | None = None,
    link: LinkRate | None = None,
    slowdown: Slowdown | None = None,
    hosts: int | None = None,
    collective_timeout: float | None = None,
) -> Any:
    """Rank 0's result of `fn(rank, world_size, *args)`, run where the user launched the command.

    Under torchrun this process is one rank of torchrun's group (possibly across hosts): it joins the
    group, runs `fn`, leaves it, and returns `fn`'s own result (rank 0's; other ranks get theirs, usually
    None). Otherwise `nproc` local workers are started with `run_distributed` (behind an emulated `link`
    and with the `slowdown` when given) and rank 0's result is returned. No `timeout` by default: a command's job
    takes as long as its work (`run_distributed`). `collective_timeout`: how long one collective may wait, there and
    under torchrun (by default `timeout`, else `COLLECTIVE_TIMEOUT_S`).
    """
    if under_torchrun() and slowdown is not None:
        raise SlowdownError("--slowdown slows down the workers a command starts itself; under torchrun the "
                            "workers are torchrun's: drop --slowdown")
    if under_torchrun():
        if link is not None or hosts is not None:
            what = "--link" if link is not None else "--hosts"
            raise LinkError(f"{what} emulates a network for the workers a command starts itself; under torchrun "
                            f"the network and hosts are the real ones: drop {what}")
        steady_allocator()
        waits = collective_timeout if collective_timeout is not None else timeout
        dist.init_process_group(backend, device_id=_gpu_of(backend, int(os.environ.get("LOCAL_RANK", 0))),
                                timeout=None if waits is None else timedelta(seconds=waits))
        try:
            return fn(dist.get_rank(), dist.get_world_size(), *args)
        finally:
            _leave_group()
    return run_distributed(fn, nproc, *args, timeout=timeout, backend=backend, link=link, slowdown=slowdown,
                           hosts=hosts, collective_timeout=collective_timeout)[0]


def _spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    timeout: float | None,
    backend: str,
    networks: Sequence[_Network | None],
    throttles: Sequence[WorkerThrottle | None],
    collective_timeout: float | None = None,
) -> list[Any]:
    """Start the workers (rank r behind `networks[r]` when not None), collect their results, reap them."""
    return _spawn_jobs([(fn, world_size, args, networks, throttles)], timeout, backend, collective_timeout)[0]


def _spawn_jobs(
    jobs: Sequence[tuple[Callable[..., Any], int, tuple[Any, ...], Sequence[_Network | None],
                         Sequence[WorkerThrottle | None]]],
    timeout: float | None,
    backend: str,
    collective_timeout: float | None = None,
) -> list[list[Any]]:
    """Start every job's workers at once (each job its own rendezvous port and process group), collect each
    job's results in turn, reap them all."""
    ctx = mp.get_context("spawn")
    oom = OomWatch()
    procs: list[list[Any]] = []
    readers: list[dict[int, Connection]] = []
    phases: list[list[Any]] = []  # each worker's phase buffer (`planner.platform.phase`)
    ports: set[int] = set()
    for _fn, world_size, *_ in jobs:
        check_gpus(backend, world_size)
    if collective_timeout is None:
        collective_timeout = timeout if timeout is not None else COLLECTIVE_TIMEOUT_S
    try:
        for index, (fn, world_size, args, networks, throttles) in enumerate(jobs):
            port = free_port()
            while port in ports:  # two jobs' ranks 0 may share a namespace: distinct rendezvous ports
                port = free_port()
            ports.add(port)
            procs.append([])
            readers.append({})
            phases.append([ctx.Array("c", PHASE_BYTES, lock=False) for _ in range(world_size)])
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                readers[-1][rank] = reader
                proc = ctx.Process(
                    target=_worker,
                    args=(fn, rank, world_size, port, backend, collective_timeout, args, writer, networks[rank],
                          throttles[rank], os.getpid(), phases[-1][rank]),
                    name=f"run_distributed-{f'job{index}-' if len(jobs) > 1 else ''}rank{rank}",
                    daemon=True,
                )
                procs[-1].append(proc)  # before start(): a Ctrl-C while it starts must not leave it unreaped
                with _interrupts_held(), _launcher_named():
                    proc.start()
                writer.close()
        return [_collect(job_procs, job_readers, timeout, oom, job_phases)
                for job_procs, job_readers, job_phases in zip(procs, readers, phases, strict=True)]
    finally:
        started = [proc for job_procs in procs for proc in job_procs if proc.pid is not None]
        for proc in started:
            if proc.is_alive():
                proc.kill()
        for proc in started:
            proc.join(timeout=10)
        for job_readers in readers:
            for reader in job_readers.values():
                reader.close()


#: One worker starts at a time in this process: LAUNCHER_ENV is process-wide, and two threads launching jobs at once
#: (as two jobs crossed over do) would otherwise each put back what the other set, and leave it set for good.
_STARTING = threading.Lock()


@contextlib.contextmanager
def _launcher_named() -> Iterator[None]:
    """LAUNCHER_ENV holds this process's pid while a worker starts (a spawned worker inherits the environment), so
    that the worker's first import of the package asks to die with this process (`planner._lifeline`)."""
    with _STARTING:
        previous = os.environ.get(LAUNCHER_ENV)
        os.environ[LAUNCHER_ENV] = str(os.getpid())
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(LAUNCHER_ENV, None)
            else:
                os.environ[LAUNCHER_ENV] = previous


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Hold off a Ctrl-C while a worker is started: the worker starts with SIGINT blocked (a signal mask survives
    fork and exec) until it ignores it, and this process takes the interrupt once the worker has its start-up
    data. Blocking the signal in this thread is not enough: the kernel then hands it to another thread (gloo's,
    a progress bar's), and Python runs the handler in the main thread at its next instruction, halfway through
    `Process.start()`, leaving a worker that reads half its data ("EOFError: Ran out of input") and no pid to
    kill it by. So, in the main thread, the handler only notes the interrupt until the start is done."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # multiprocessing starts its resource tracker with SIGINT blocked and then unblocks it: start it before the
    # block, so starting a worker does not lift the block halfway
    resource_tracker.ensure_running()
    noted: list[tuple[int, Any]] = []
    # (a handler Python did not install reads None and could not be put back: it is left alone)
    in_main = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not None
    handler = signal.signal(signal.SIGINT, lambda signum, frame: noted.append((signum, frame))) if in_main else None
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a signal held by the mask is handled (noted) here
        if in_main:
            signal.signal(signal.SIGINT, handler)
            if noted:
                _deliver(handler, *noted[0])


def _deliver(handler: Any, signum: int, frame: Any) -> None:
    """What SIGINT would have done under `handler`, had it not been held."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)


def run_jobs(
    jobs: Sequence[tuple[Callable[..., Any], int, tuple[Any, ...]]],
    *,
    timeout: float = 120,
    backend: str = "gloo",
    link: LinkRate | None = None,
    hosts: int | None = None,
) -> list[list[Any]]:
    """Run several distributed jobs at once on this machine, each `(fn, world_size, args)` with its own process
    group, as separate launches would; returns each job's results by rank.

    Behind an emulated `link`, rank r of every job lives in the same namespace (host r), so the jobs share
    each host's shaped egress, as jobs sharing machines share their network cards. With `hosts` (jobs of one
    world size), rank r of every job lives on emulated host r // (world_size / hosts), as `run_distributed`
    spreads one job. The first failing worker's exception is raised (and every worker of every job killed), as
    `run_distributed` does.
    """
    if not jobs or any(world_size < 1 for _, world_size, _ in jobs):
        raise ValueError(f"every job needs `world_size >= 1`, got {[w for _, w, _ in jobs]}")
    if hosts is not None and len({world_size for _, world_size, _ in jobs}) != 1:
        raise ValueError(f"emulated hosts need jobs of one world size, got {[w for _, w, _ in jobs]}")
    for fn, _, _ in jobs:
        _check_picklable(fn)
    workers = max(world_size for _, world_size, _ in jobs)
    with contextlib.ExitStack() as stack:
        networks: list[_Network | None] = [None] * workers
        if link is not None or hosts is not None:
            networks = _emulated_networks(stack, link, workers, hosts)
        return _spawn_jobs([(fn, world_size, args, networks[:world_size], [None] * world_size)
                            for fn, world_size, args in jobs], timeout, backend)


def _collect(procs: list[Any], readers: dict[int, Connection], timeout: float | None,
             oom: OomWatch | None = None, phases: Sequence[Any] = ()) -> list[Any]:
    """Wait for every worker's outcome (or death) until `timeout` (None: for as long as they work); after a
    failure, wait only a grace period. `phases`: each rank's phase buffer, read to say where a failure was."""

    def phase_of(rank: int) -> str:
        return read_phase(phases[rank]) if rank < len(phases) else ""

    results: dict[int, Any] = {}
    failures: list[tuple[bool, float, int, BaseException | None, str]] = []  # (sent something, when, rank, ...)
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = dict(readers)
    sentinel_rank = {procs[r].sentinel: r for r in pending}
    while pending:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            break
        ready = wait([*pending.values(), *(procs[r].sentinel for r in pending)], timeout=remaining)
        for obj in ready:
            rank = sentinel_rank[obj] if isinstance(obj, int) else _rank_of(pending, obj)
            if rank is None or rank not in pending:
                continue
            message = _receive(pending[rank], procs[rank], died=isinstance(obj, int), oom=oom)
            if message is None:
                continue
            del pending[rank]
            if message[0] == "ok":
                results[rank] = message[1]
            else:
                _, exc, text, when, *died_of = message
                failures.append((not died_of, when, rank, exc, text))
                grace = time.monotonic() + FAILURE_GRACE_S
                deadline = grace if deadline is None else min(deadline, grace)
    if failures:
        # a worker that died is the cause of its peers' broken connections, whenever the parent noticed it;
        # otherwise the earliest failure is
        *_, rank, exc, text = min(failures, key=lambda f: f[:3])
        _raise_worker_error(rank, exc, text, phase_of(rank))
    if pending:
        where = "; ".join(f"rank {r} during: {phase_of(r)}" for r in sorted(pending) if phase_of(r))
        raise DistributedError(
            f"worker rank(s) {sorted(pending)} of {len(procs)} did not finish within {timeout:g} s"
            f"{f' ({where})' if where else ''}; all workers were killed"
        )
    return [results[r] for r in range(len(procs))]


def _receive(reader: Connection, proc: Any, died: bool, oom: OomWatch | None = None) -> tuple[Any, ...] | None:
    """The worker's outcome if it sent one; an error if it died without; None if there is nothing yet."""
    if reader.poll():
        try:
            payload = reader.recv_bytes()
        except (EOFError, OSError):
            pass
        else:
            try:
                # Our own spawned worker's result over a private pipe (what Connection.recv unpickled before);
                # never a file: plan and profile files are JSON.
                message: tuple[Any, ...] = pickle.loads(payload)
            except Exception as exc:  # the result pickled in the worker but does not unpickle here
                return ("error", None, f"could not read the worker's result: {exc!r}\n", time.time())
            return message
    elif not died:
        return None
    proc.join(timeout=1)
    return ("error", None, _death(proc, oom) + "\n", time.time(), True)


def _rank_of(pending: dict[int, Connection], conn: object) -> int | None:
    for rank, reader in pending.items():
        if reader is conn:
            return rank
    return None


def broadcast_json(value: Any, *, group: Any = None, device: torch.device | None = None) -> Any:
    """Rank 0's JSON-compatible `value` (of `group`) on every rank of it, sent as UTF-8 JSON in a tensor.

    Plans travel between ranks as data: nothing is unpickled, so receiving one never runs code. Every rank
    must call it; the others' `value` is ignored. `device`: where the tensors live (a GPU for nccl).
    """
    device = device or torch.device("cpu")
    src = dist.get_global_rank(group, 0) if group is not None else 0
    payload = json.dumps(value).encode() if dist.get_rank(group) == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if payload:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(data, src=src, group=group)
    return json.loads(data.cpu().numpy().tobytes().decode())
