"""The test session's shared costs: the warm gloo workers of `tests.pool`, stopped when the session ends."""

from __future__ import annotations

import pytest

from tests import pool


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spawns: starts its own worker processes (a link, hosts, the launcher's own "
                                       "behaviour): not on the warm workers of tests.pool")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    pool.close_all()
