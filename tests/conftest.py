"""The test session's shared costs: the warm gloo workers of `tests.pool`, used by the tests' own distributed cases
and by the commands a test runs in its own process, stopped when the session ends."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from planner.commands import common
from planner.platform import launch
from tests import pool


def pytest_configure(config: pytest.Config) -> None:
    # `make test` runs two test processes on this machine's two cores: one thread each, as the workers have
    # (`planner.platform.launch`). Two threads per process oversubscribe the cores: the single-process training
    # tests of tests/test_kfac_training.py took 170 s so, 36 s with one.
    torch.set_num_threads(1)
    config.addinivalue_line("markers", "spawns: starts its own worker processes (a link, hosts, the launcher's own "
                                       "behaviour): not on the warm workers of tests.pool")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    pool.close_all()


def _warm_when_plain(spawn: Any) -> Any:
    """`run_distributed` as the commands call it, on the warm workers when the call asks nothing of the launcher
    that they lack: gloo, no emulated link or hosts, no slowed worker, no collective timeout shorter than theirs.
    Anything else spawns as it would."""

    def run_distributed(fn: Any, world_size: int, *args: Any, timeout: float | None = 120, backend: str = "gloo",
                        link: Any = None, slowdown: Any = None, hosts: Any = None,
                        collective_timeout: float | None = None) -> list[Any]:
        waits = collective_timeout if collective_timeout is not None else timeout
        plain = (backend == "gloo" and link is None and hosts is None
                 and (slowdown is None or not slowdown.factors)
                 and (waits is None or waits >= pool.COLLECTIVE_TIMEOUT_S))
        if plain:
            deadline = pool.COLLECTIVE_TIMEOUT_S if timeout is None else min(timeout, pool.COLLECTIVE_TIMEOUT_S)
            return pool.run_warm(fn, world_size, *args, timeout=deadline)
        return spawn(fn, world_size, *args, timeout=timeout, backend=backend, link=link, slowdown=slowdown,
                     hosts=hosts, collective_timeout=collective_timeout)

    return run_distributed


@pytest.fixture(autouse=True)
def _race_log_of_the_test(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A command a test runs logs its races in a file of the test's own, not in the repository's runs/."""
    name = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]
    monkeypatch.setattr(common, "DEFAULT_RACE_LOG", tmp_path_factory.getbasetemp() / "race-logs" / f"{name}.json")


@pytest.fixture(autouse=True)
def _commands_on_warm_workers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A command a test runs in its own process (`planner.commands.cli.main`) starts its workers through
    `launch.run_distributed`; unless the test carries the `spawns` mark, plain launches run on the warm workers."""
    if request.node.get_closest_marker("spawns") is None:
        monkeypatch.setattr(launch, "run_distributed", _warm_when_plain(launch.run_distributed))
    yield
