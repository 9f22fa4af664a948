"""The K-FAC bench beside the real kfac-pytorch: which of its strategies get a row, and, where the library is
installed (`make bench-env`; never in the project's own environment), that its rows run and are named apart from
this runtime's layouts."""

from __future__ import annotations

import pytest

from planner.sessions.bench_kfac import LAYOUT_ROWS, PEER_REFERENCE, peer_variants


def test_one_row_per_distinct_gradient_worker_fraction() -> None:
    # 2 workers: MEM_OPT (1/2) and HYBRID_OPT (1/2) are one strategy.
    assert peer_variants(2) == [("kfac-pytorch COMM_OPT", "COMM_OPT"),
                                ("kfac-pytorch MEM_OPT = HYBRID_OPT", "MEM_OPT")]
    assert peer_variants(4) == [("kfac-pytorch COMM_OPT", "COMM_OPT"), ("kfac-pytorch MEM_OPT", "MEM_OPT"),
                                ("kfac-pytorch HYBRID_OPT", "HYBRID_OPT")]
    # 1 worker: every strategy is COMM_OPT.
    assert peer_variants(1) == [("kfac-pytorch COMM_OPT = MEM_OPT", "COMM_OPT"),
                                ("kfac-pytorch HYBRID_OPT", "HYBRID_OPT")]
    assert peer_variants(2)[0][0] == PEER_REFERENCE


def test_the_real_library_runs_beside_the_layouts() -> None:
    pytest.importorskip("kfac.preconditioner", reason="kfac-pytorch is installed in the bench environment only")
    from planner.sessions.bench_kfac import KFACBenchConfig, run_kfac_bench
    from planner.strategies.kfac_plan import make_kfac_plan
    from tests.factories import synthetic_profile

    # The CNN's ReLUs work in place, which kfac-pytorch's backward hooks refuse: the bench runs them out of place.
    plan = make_kfac_plan(synthetic_profile("cnn"), factor_update_steps=1, inv_update_steps=2)
    rows = run_kfac_bench(KFACBenchConfig(plan=plan, model="cnn", steps=4, show_progress=False))
    assert rows is not None
    names = [r.name for r in rows]
    assert names[-2:] == ["kfac-pytorch COMM_OPT", "kfac-pytorch MEM_OPT = HYBRID_OPT"]
    assert set(LAYOUT_ROWS.values()) <= set(names) and "kfac-pytorch" not in names
    for r in rows:
        assert r.reference == PEER_REFERENCE and r.median_s > 0 and r.steps == 6
    assert next(r for r in rows if r.name == PEER_REFERENCE).speedup == 1.0
    assert all(r.predicted_s is None for r in rows if r.name.startswith("kfac-pytorch"))
