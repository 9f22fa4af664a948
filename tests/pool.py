"""Warm gloo workers the tests share: `run_warm(fn, world_size, *args)` returns what
`run_distributed(fn, world_size, *args)` would, on processes started once per test session (per world size) instead
of once per call. Starting two workers (a spawned interpreter each, torch imported, a gloo rendezvous) costs about
2 s on this 2-core machine; a case on warm workers costs what its own work costs.

Each case starts from the state a fresh worker has where a test could tell: torch's default generator at its seed of
a new process, the process groups a case made destroyed (the default group stays), `torch.set_num_threads(1)`, the
environment as it was. A case that fails, or hangs past its timeout, takes its workers with it: they are killed and
the next case starts new ones (so a peer left waiting in a collective cannot leak into the next case).

What must start its own workers keeps calling `run_distributed`: an emulated link or hosts, a slowed worker, a
backend other than gloo, the launcher's own behaviour (deadlines, deaths, signals), environment variables the
workers must read at start. Such tests carry the `spawns` mark (conftest.py). A command a test runs in its own
process (`planner.commands.cli.main`) gets the warm workers too for its plain launches, unless its test carries the
mark (conftest.py, `_commands_on_warm_workers`).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import pickle
import sys
import time
import traceback
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planner.platform.launch import free_port
from planner.types import DistributedError, RemoteTraceback

#: The collective timeout of the warm workers' group: the longest `timeout` a converted call passed.
COLLECTIVE_TIMEOUT_S = 300.0
#: After one rank of a case fails, how long the others get to report before the workers are replaced. The first
#: failure is what the case raises whatever they report (`_Workers.run`), so this only delays the replacement (a
#: peer left waiting in a collective for the failed rank reports nothing before its collective timeout).
FAILURE_GRACE_S = 0.5


def _serve(rank: int, world_size: int, port: int, conn: Connection, parent: int) -> None:
    """One warm worker: join the group once, then run each case sent over `conn` until told to stop."""
    from planner._lifeline import die_with
    from planner.platform.memory import steady_allocator

    die_with(parent)
    torch.set_num_threads(1)
    steady_allocator()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    seed = torch.initial_seed()  # a new process's; every case starts from it, as a fresh worker would
    environment = dict(os.environ)
    cores = os.sched_getaffinity(0)
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            break
        fn, args = pickle.loads(request)  # our own parent's pickled function and arguments, over a private pipe
        if fn is None:
            break
        torch.manual_seed(seed)
        settings = _settings()
        try:
            message: tuple[Any, ...] = ("ok", fn(rank, world_size, *args))
        except BaseException as exc:
            message = ("error", exc, traceback.format_exc())
        _reset(environment, cores)
        changed = _restore(settings)
        if changed and message[0] == "ok":
            message = ("error", None, f"left module settings changed (put back now): {', '.join(changed)}; "
                       "a case on warm workers must undo what it patches\n")
        try:
            payload = pickle.dumps(message)
        except Exception as exc:
            payload = pickle.dumps(("error", None, f"could not send the worker's result to the parent: {exc!r}\n"))
        conn.send_bytes(payload)
    dist.destroy_process_group()


def _reset(environment: dict[str, str], cores: set[int]) -> None:
    """Undo what a case may have left that a fresh worker would not have: its subgroups, its threads setting,
    its environment changes, the cores it pinned itself to (`planner.sessions.bench_crossover` pins each rank),
    its garbage (modules in reference cycles holding hooks). What survives the collection is frozen (`gc.freeze`),
    so that later collections scan only what later cases make, not all of torch again."""
    gc.collect()
    gc.freeze()
    world = dist.group.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)
    torch.set_num_threads(1)
    if os.sched_getaffinity(0) != cores:
        os.sched_setaffinity(0, cores)
    if dict(os.environ) != environment:
        os.environ.clear()
        os.environ.update(environment)


def _settings() -> dict[tuple[str, str], Any]:
    """The project's module-level settings as they are now: every number, string or flag named in capitals
    (`_MAX_CHAIN`, `COLLECTIVE_TIMEOUT_S`) in a loaded `planner` module. A case that patches one (to force a
    refusal, say) would otherwise leave it patched for every later case on these workers."""
    found = {}
    for name, module in list(sys.modules.items()):
        if name == "planner" or name.startswith("planner."):
            for key, value in list(vars(module).items()):
                if key.lstrip("_").isupper() and type(value) in (int, float, str, bool):
                    found[name, key] = value
    return found


def _restore(settings: dict[tuple[str, str], Any]) -> list[str]:
    """Put back every setting in `settings` that a case changed; the changes, named."""
    changed = []
    for (name, key), value in settings.items():
        module = sys.modules.get(name)
        now = getattr(module, key, value) if module is not None else value
        if now is not value and now != value:  # identity first: a NaN setting equals nothing, itself included
            changed.append(f"{name}.{key} ({value!r} -> {now!r})")
            setattr(module, key, value)
    return changed


class _Workers:
    """`world_size` warm workers of one gloo group."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.world_size = world_size
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_serve, args=(rank, world_size, port, child_end, os.getpid()),
                               name=f"warm-worker-{world_size}-rank{rank}", daemon=True)
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)

    def run(self, fn: Any, args: tuple[Any, ...], timeout: float) -> list[Any]:
        request = pickle.dumps((fn, args))
        for conn in self.conns:
            conn.send_bytes(request)
        results: dict[int, Any] = {}
        failures: list[tuple[int, BaseException | None, str]] = []
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self.conns))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            sentinels = {self.procs[r].sentinel: r for r in pending}
            for ready in wait([*pending.values(), *sentinels], timeout=remaining):
                rank = sentinels[ready] if isinstance(ready, int) else next(r for r, c in pending.items()
                                                                               if c is ready)
                if rank not in pending:
                    continue
                conn = pending.pop(rank)
                try:
                    message = pickle.loads(conn.recv_bytes())  # our own worker's result, over a private pipe
                except (EOFError, OSError):
                    self.procs[rank].join(timeout=1)
                    message = ("error", None, f"was killed or exited (code {self.procs[rank].exitcode})\n")
                if message[0] == "ok":
                    results[rank] = message[1]
                else:
                    failures.append((rank, message[1], message[2]))
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if failures:
            rank, exc, text = failures[0]
            remote = RemoteTraceback(f"worker rank {rank} failed:\n{text}", rank)
            if exc is None:
                raise DistributedError(f"worker rank {rank} {text.strip().splitlines()[-1]}") from remote
            raise exc from remote
        if pending:
            raise DistributedError(f"worker rank(s) {sorted(pending)} of {self.world_size} did not finish within "
                                   f"{timeout:g} s; all workers were killed")
        return [results[r] for r in range(self.world_size)]

    def close(self, *, kill: bool = False) -> None:
        if not kill:
            for conn in self.conns:
                with contextlib.suppress(OSError):  # a worker already gone
                    conn.send_bytes(pickle.dumps((None, ())))
            for proc in self.procs:
                proc.join(timeout=10)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        for conn in self.conns:
            conn.close()


_pools: dict[int, _Workers] = {}


def run_warm(fn: Any, world_size: int, *args: Any, timeout: float = 120) -> list[Any]:
    """`run_distributed(fn, world_size, *args, timeout=timeout)` on the session's warm gloo workers of that world
    size (started at the first call): the results by rank, or the first failing rank's exception, re-raised with
    its traceback text as the cause. After a failure or a timeout the workers are replaced."""
    if not 0 < timeout <= COLLECTIVE_TIMEOUT_S:
        raise ValueError(f"`0 < timeout <= {COLLECTIVE_TIMEOUT_S:g}` must hold for warm workers, but got {timeout}")
    workers = _pools.get(world_size)
    if workers is None:
        workers = _pools[world_size] = _Workers(world_size)
    try:
        return workers.run(fn, args, timeout)
    except BaseException:
        del _pools[world_size]
        workers.close(kill=True)
        raise


#: Warm workers for jobs run side by side (`run_jobs_warm`): (the job's index in its call, world size) -> workers.
_job_pools: dict[tuple[int, int], _Workers] = {}


def run_jobs_warm(jobs: list[tuple[Any, int, tuple[Any, ...]]], timeout: float = 120) -> list[list[Any]]:
    """`launch.run_jobs(jobs, timeout=timeout)` (plain jobs: gloo, no link or hosts) on the session's warm workers:
    the k-th job of every call on the k-th group of workers of its world size, each group its own gloo group in its
    own processes (started at the first call that needs it), the jobs of a call run at once, as the launcher runs
    them. Each job's results by rank; a failing job's exception. After a failure or a timeout every group of the
    call is replaced: the other jobs' workers would wait for the failed one until their deadline."""
    if not 0 < timeout <= COLLECTIVE_TIMEOUT_S:
        raise ValueError(f"`0 < timeout <= {COLLECTIVE_TIMEOUT_S:g}` must hold for warm workers, but got {timeout}")
    keys = [(k, size) for k, (_, size, _) in enumerate(jobs)]
    for key in keys:
        if key not in _job_pools:
            _job_pools[key] = _Workers(key[1])
    workers = [_job_pools[key] for key in keys]
    with ThreadPoolExecutor(len(jobs)) as threads:
        runs = [threads.submit(w.run, fn, args, timeout) for w, (fn, _, args) in zip(workers, jobs, strict=True)]
        done, _ = wait_futures(runs, return_when=FIRST_EXCEPTION)
        failed = [run.exception() for run in done if run.exception() is not None]
        if failed:
            for key in keys:
                _job_pools.pop(key).close(kill=True)
            raise failed[0]  # type: ignore[misc]
        return [run.result() for run in runs]


def close_all() -> None:
    """Stop every warm worker (the session's end)."""
    while _pools:
        _, workers = _pools.popitem()
        workers.close()
    while _job_pools:
        _, workers = _job_pools.popitem()
        workers.close()


atexit.register(close_all)
