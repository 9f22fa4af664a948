"""Crossover in the runtime: two jobs of 2 gloo workers each, separate launches sharing only the gate files.
Crossing over changes timing only (parameters equal each job run alone, exactly), a killed job releases its
devices (the other finishes, and the next run finds no stale lock), a job the pairing leaves alone runs
without a gate, and a plan the pairing does not know is refused in one line."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import planner.runtime.exchange
from planner.contracts.layers import gradient_layers
from planner.contracts.pairing import PairingJob, PairingPlan
from planner.contracts.plan import Plan, Prediction
from planner.costmodel.problem import groups_for
from planner.platform.launch import run_distributed, run_jobs
from planner.runtime import GradientExchange
from planner.runtime.crossover import ProbeSchedule
from planner.sessions.pair import make_pairing
from planner.types import DistributedError, PlanMismatchError, PlannerFileError, Strategy
from tests.factories import plan_with_groups
from tests.pool import run_jobs_warm, run_warm

STEPS = 6


class Shaped(nn.Module):
    """Shaped like real models: a tied weight, a frozen layer, BatchNorm, an unused parameter, and parameters
    registered in another order than used."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(12, 4)  # registered first, used last
        self.frozen = nn.Linear(10, 10)
        self.frozen.requires_grad_(False)
        self.body = nn.Linear(10, 12)
        self.norm = nn.BatchNorm1d(12)
        self.unused = nn.Linear(3, 3)
        self.tail = nn.Linear(10, 12, bias=False)
        self.tail.weight = self.body.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.body(self.frozen(x))))
        return self.head(h + torch.tanh(self.tail(x)))


def build(kind: str) -> nn.Module:
    torch.manual_seed({"wide": 1, "deep": 2, "other": 3, "shaped": 4}[kind])
    if kind == "shaped":
        return Shaped()
    if kind == "wide":
        return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    if kind == "deep":
        return nn.Sequential(nn.Linear(10, 12), nn.Tanh(), nn.Linear(12, 12), nn.BatchNorm1d(12), nn.Tanh(),
                             nn.Linear(12, 4))
    return nn.Sequential(nn.Linear(10, 4))


def job_plan(kind: str, strategy: Strategy = Strategy.DENSE, world_size: int = 2) -> Plan:
    """A plan of one group per layer, with a made-up timeline (10 ms of compute, then 4 ms of exposed comm)."""
    model = build(kind)
    layers = gradient_layers(model)
    density = 0.5 if strategy is Strategy.TOPK else None
    plan = plan_with_groups(model, groups_for(layers, tuple(range(1, len(layers) + 1)), strategy, density),
                            strategy, density, name=kind, world_size=world_size)
    return replace(plan, predicted=Prediction(iteration_s=0.014, compute_s=0.010, exposed_comm_s=0.004,
                                              comm_s=0.004))


def write_pairing(tmp_path: Path, kinds: list[str], strategies: list[Strategy] | None = None) -> tuple[str, list[str]]:
    """Each job's plan file and the pairing plan made from them (`planner pair`'s solver)."""
    paths = []
    jobs = []
    for k, kind in enumerate(kinds):
        plan = job_plan(kind, (strategies or [Strategy.DENSE] * len(kinds))[k])
        path = tmp_path / f"{kind}.json"
        plan.save(path)
        paths.append(str(path))
        jobs.append(PairingJob.from_plan(Plan.load(path), str(path), name=kind, samples=16))
    pairing, _ = make_pairing(jobs)
    out = tmp_path / "pairing.json"
    pairing.save(out)
    return str(out), paths


def _job_worker(rank: int, world_size: int, kind: str, plan_path: str, pairing: str | None, gate_dir: str,
                die_at: int | None, probe: ProbeSchedule | bool = False) -> dict[str, Any]:
    model = build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    exchange = GradientExchange.from_file(model, plan_path, crossover=pairing, crossover_dir=gate_dir,
                                          crossover_timeout_s=60.0, crossover_probe=probe)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
        loss = F.cross_entropy(model(x), y)
        if die_at == step and rank == 0:
            assert exchange.gate is not None and exchange.gate.held
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step, holding the device: no clean-up runs
        loss.backward()
        exchange.synchronize()
        assert exchange.gate is None or not exchange.gate.held  # handed over while the collectives run
        opt.step()
        opt.zero_grad(set_to_none=True)
        time.sleep(0.001)
    taken = exchange.gate.acquisitions if exchange.gate is not None else None
    steps = exchange.gate.steps if exchange.gate is not None else None
    exchange.close()
    return {"params": {n: p.detach().numpy().copy() for n, p in model.named_parameters()}, "gate": taken,
            "steps": steps}


#: A probe that switches between free and gated steps every few milliseconds, within the test's few steps.
FLICKER = ProbeSchedule(warmup_s=0.0, window_s=0.004, every_s=0.01)


@pytest.mark.parametrize(("strategies", "probe", "launched"), [([Strategy.DENSE, Strategy.DENSE], False, True),
                                                               ([Strategy.TOPK, Strategy.DENSE], False, False),
                                                               ([Strategy.TOPK, Strategy.DENSE], FLICKER, False)],
                         ids=["dense+dense", "topk+dense", "topk+shaped probing"])
def test_crossing_over_changes_timing_only(tmp_path: Path, strategies: list[Strategy],
                                           probe: ProbeSchedule | bool, launched: bool) -> None:
    """`launched`: the two jobs started by the launcher (`run_jobs`), each its own workers; else on warm workers
    (`tests.pool.run_jobs_warm`: each job its own process group in its own processes, run at once, as launched,
    without starting four interpreters again for each case)."""
    second = "deep" if probe is False else "shaped"
    pairing, (wide, deep) = write_pairing(tmp_path, ["wide", second], strategies)
    assert PairingPlan.load(pairing).pairs == ((0, 1),)
    gates = str(tmp_path / "gates")
    jobs = [(_job_worker, 2, ("wide", wide, pairing, gates, None, probe)),
            (_job_worker, 2, (second, deep, pairing, gates, None, probe))]
    crossed = run_jobs(jobs) if launched else run_jobs_warm(jobs)
    for kind, path, together in (("wide", wide, crossed[0]), (second, deep, crossed[1])):
        alone = run_warm(_job_worker, 2, kind, path, None, gates, None)
        for rank in range(2):
            assert together[rank]["steps"] == STEPS
            if probe is False:
                assert together[rank]["gate"] == STEPS  # every step took the device's gate once
            else:  # some steps ran free
                assert 0 <= together[rank]["gate"] <= STEPS
            assert alone[rank]["gate"] is None
            for name, value in alone[rank]["params"].items():
                assert (together[rank]["params"][name] == value).all(), f"{kind} rank {rank} {name}"
    names = sorted(p.name for p in Path(gates).glob("*.lock"))  # the pair's gate on this host, left unlocked
    assert len(names) == 1 and "-pair0-" in names[0]


@pytest.mark.spawns
def test_a_killed_job_releases_its_devices(tmp_path: Path) -> None:
    pairing, (wide, deep) = write_pairing(tmp_path, ["wide", "deep"])
    gates = str(tmp_path / "gates")
    outcome: dict[str, Any] = {}

    def launch(name: str, *args: Any) -> None:
        try:
            outcome[name] = run_distributed(_job_worker, 2, *args, timeout=90)  # two jobs at once: their own workers
        except Exception as exc:  # the killed job's launch fails; that is the point
            outcome[name] = exc

    killed = threading.Thread(target=launch, args=("wide", "wide", wide, pairing, gates, 2))
    survivor = threading.Thread(target=launch, args=("deep", "deep", deep, pairing, gates, None))
    started = time.monotonic()
    killed.start()
    survivor.start()
    survivor.join(timeout=120)
    killed.join(timeout=120)
    assert not survivor.is_alive() and not killed.is_alive()
    assert time.monotonic() - started < 120
    # the killed job's launch fails: rank 0 died without a result, or rank 1's connection to it broke, whichever
    # the launcher sees first
    assert isinstance(outcome["wide"], DistributedError | RuntimeError), outcome["wide"]
    assert [r["gate"] for r in outcome["deep"]] == [STEPS, STEPS]
    # the next run finds no stale lock: the survivor runs again, its partner absent, and takes its gates freely
    again = run_warm(_job_worker, 2, "deep", deep, pairing, gates, None, timeout=90)
    assert [r["gate"] for r in again] == [STEPS, STEPS]


def test_a_job_the_pairing_leaves_alone_has_no_gate_and_unknown_plans_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wide_plan, deep_plan = job_plan("wide", world_size=1), job_plan("deep", world_size=1)
    # a third job that takes far longer than either: pairing it would only slow the pair
    lone_plan = replace(job_plan("other", world_size=1), predicted=Prediction(iteration_s=5.0, compute_s=5.0,
                                                                exposed_comm_s=0.0, comm_s=0.0))
    jobs = []
    for name, plan in (("wide", wide_plan), ("deep", deep_plan), ("other", lone_plan)):
        plan.save(tmp_path / f"{name}.json")
        jobs.append(PairingJob.from_plan(Plan.load(tmp_path / f"{name}.json"), str(tmp_path / f"{name}.json"),
                                         name=name, samples=16))
    pairing, _ = make_pairing(jobs)
    assert pairing.alone == (2,) and pairing.pairs == ((0, 1),)
    path = tmp_path / "pairing.json"
    pairing.save(path)
    gates = tmp_path / "gates"
    lone = GradientExchange(build("other"), Plan.load(tmp_path / "other.json"), crossover=str(path),
                            crossover_dir=gates, model_name="other")
    assert lone.gate is None
    lone.close()
    model = build("wide")  # a paired job takes its device's gate for forward and backward
    paired = GradientExchange(model, Plan.load(tmp_path / "wide.json"), crossover=str(path), crossover_dir=gates,
                              model_name="wide")
    assert paired.gate is not None and not paired.gate.held
    F.cross_entropy(model(torch.randn(4, 10)), torch.tensor([0, 1, 2, 3])).backward()
    assert paired.gate.held
    idle: list[tuple[torch.device, bool]] = []  # the device waited on, and whether the gate was held then
    monkeypatch.setattr(planner.runtime.exchange, "device_idle", lambda device: idle.append((device, paired.gate.held)))
    paired.synchronize()
    assert idle == [(torch.device("cpu"), True)]  # the device has run the backward before the gate goes
    assert not paired.gate.held and paired.gate.acquisitions == 1
    with torch.no_grad():
        model(torch.randn(2, 10))  # an evaluation forward does not take the device
    assert not paired.gate.held
    paired.close()
    # the same plan re-solved (another `created`): another fingerprint, not in the pairing
    stranger = replace(job_plan("wide", world_size=1), created="2026-02-02T00:00:00+00:00")
    with pytest.raises(PlanMismatchError, match=r"has no job running this plan .*re-run `planner pair`"):
        GradientExchange(build("wide"), stranger, crossover=str(path), crossover_dir=gates, model_name="wide")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(PlannerFileError, match="cannot create the crossover gate"):
        GradientExchange(build("wide"), Plan.load(tmp_path / "wide.json"), crossover=str(path),
                         crossover_dir=blocker / "gates", model_name="wide")
