"""`planner race` of a K-FAC plan: the plan's layout raced against kfac-pytorch's reference layouts in real K-FAC
steps, in the same worker processes, under the race's rule (`planner.strategies.race_rule`).

The arms, simplest first: kfac-pytorch's default layout (COMM_OPT: whole factors in 25 MB buckets, each layer's
inverses on one worker and broadcast, every worker preconditioning), its MEM_OPT layout (each layer preconditioned
by its inverse worker, which broadcasts the preconditioned gradient; HYBRID_OPT too at two workers), every factor
inverted on every worker ("everywhere"), the plan with every worker preconditioning (where the plan gives some layer
a preconditioner rank), the plan, then the plan's runners-up that hold a K-FAC layout (the solved layout, after a
race kept a reference one). An arm whose decisions equal a simpler arm's does not race twice. The layouts run in this
runtime with this project's kernels, as the bench's rows of them do: the race settles the layout, not the kernels.

A K-FAC step is not like the next (factors every `factor_update_steps`, inverses every `inv_update_steps`), so an
arm's block is one window of `inv_update_steps` steps, from the window's first step: every arm's block holds the
same factor and inverse updates. The ratios are to kfac-pytorch's default layout, the reference that runs every
round (DDP is not a choice here: plain SGD is not K-FAC).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from planner.console import progress
from planner.contracts.fingerprint import model_info
from planner.contracts.kfac_section import KFACSection, kfac_layers
from planner.contracts.plan import Plan
from planner.models import build_workload
from planner.platform import launch  # its launchers called through it: tests replace them there
from planner.sessions.bench import WorkerSetup, bench_backend, timed_step
from planner.sessions.race import RUNNER_UP, RaceConfig, race_rounds
from planner.strategies.kfac_plan import PLAN_EVERYONE, reference_sections
from planner.types import PlanMismatchError

if TYPE_CHECKING:
    from planner.contracts.race_record import RaceRecord

__all__ = ["COMM_OPT", "DAMPING", "KFACArm", "kfac_finalists", "kfac_race_worker", "run_kfac_race",
           "with_kfac_race"]

#: The reference arm: kfac-pytorch's default layout, which every ratio is measured against.
COMM_OPT = "COMM_OPT layout"
#: The race's names of the plan's reference layouts (`planner.strategies.kfac_plan.reference_sections`), in the
#: order of simplicity.
LAYOUTS = {"kfac-pytorch": COMM_OPT, "kaisa-mem-opt": "MEM_OPT layout", "everywhere": "every worker inverts"}
#: K-FAC's damping in the race's steps (as the bench's).
DAMPING = 1e-3
#: What the solved layout is named among the runners-up once a race kept another arm.
SOLVED = "solved layout"


@dataclass(frozen=True)
class KFACArm:
    """One finalist: its name in the race, its K-FAC section and its predicted seconds per step."""

    name: str
    section: KFACSection
    predicted_s: float | None


def _decisions(section: KFACSection) -> tuple[object, ...]:
    return (section.a_buffers, section.g_buffers, tuple(sorted(section.owners.items(), key=str)),
            tuple(sorted(section.preconditioners.items(), key=str)), section.whole_factors, section.mixed_whole)


def _arm(name: str, section: KFACSection) -> KFACArm:
    return KFACArm(name, section, None if section.predicted is None else section.predicted.step_s)


def kfac_finalists(plan: Plan) -> list[KFACArm]:
    """The arms of a K-FAC plan's race, simplest first (see the module docstring)."""
    if plan.kfac is None:
        raise PlanMismatchError("the plan has no kfac section; make one with `planner solve PROFILE --strategy kfac`")
    refs = reference_sections(plan)
    candidates = [_arm(race_name, refs[name]) for name, race_name in LAYOUTS.items() if name in refs]
    if PLAN_EVERYONE in refs:
        candidates.append(_arm(PLAN_EVERYONE, refs[PLAN_EVERYONE]))
    candidates.append(_arm("plan", plan.kfac))
    candidates += [_arm(f"{RUNNER_UP}{name}", other.kfac) for name, other in plan.runners_up.items()
                   if other.kfac is not None]
    arms: list[KFACArm] = []
    for arm in candidates:
        if all(_decisions(arm.section) != _decisions(kept.section) for kept in arms):
            arms.append(arm)
    return arms


def with_kfac_race(plan: Plan, record: RaceRecord) -> Plan:
    """`plan` with the race `record`, to write back to its file. Where the race kept another arm than the plan, its
    layout becomes the file's K-FAC section (the runtime runs the file's), with the solve's predictions and
    intervals of every layout, and the solved layout one of the runners-up (`SOLVED`)."""
    assert plan.kfac is not None
    if record.kept == "plan":
        return replace(plan, race=record)
    kept = next(arm for arm in kfac_finalists(plan) if arm.name == record.kept)
    solved = plan.kfac
    section = replace(kept.section, skip=solved.skip, left_out=solved.left_out, baselines=solved.baselines,
                      intervals=solved.intervals, lower_bound_s=solved.lower_bound_s, verdict=None)
    others = {name: other for name, other in plan.runners_up.items() if f"{RUNNER_UP}{name}" != record.kept}
    if record.kept.startswith(RUNNER_UP):  # a runner-up's layout comes back: its plan, as solved, is the file's
        section = plan.runners_up[record.kept.removeprefix(RUNNER_UP)].kfac or section
    name = SOLVED
    while name in others:
        name += " (earlier)"
    return replace(plan, kfac=section, race=record, runners_up={name: replace(plan, runners_up={}, race=None),
                                                                  **others})


def kfac_race_worker(rank: int, world_size: int, config: RaceConfig, every_rank: bool = False) -> RaceRecord | None:
    """Build every K-FAC finalist on this rank, warm each up for whole windows, and race them window by window;
    rank 0 returns the result (`every_rank`: every rank its own, which is rank 0's)."""
    from planner.runtime import KFACPreconditioner  # deferred (start-up: the commands import this module)

    (plan,) = config.plans
    assert plan.kfac is not None
    setup = WorkerSetup.on_this_rank(rank, world_size, config.model, config.batch_size, config.plans)
    device, batch = setup.device, setup.batch
    arms = kfac_finalists(plan)
    window = plan.kfac.inv_update_steps
    runners = {}
    for arm in arms:
        wl = build_workload(config.model, batch_size=config.batch_size)  # the same seed: the same weights everywhere
        wl.module.to(device)
        runtime = KFACPreconditioner(wl.module, plan=plan, kfac=arm.section, lr=config.lr, damping=DAMPING)
        opt = torch.optim.SGD(wl.module.parameters(), lr=config.lr, momentum=0.9)
        runners[arm.name] = (wl, runtime, opt)

    def step(name: str) -> float:
        wl, runtime, opt = runners[name]
        return timed_step(wl.module, wl.loss_fn, batch, opt, runtime.step)

    warm_windows = max(1, -(-config.warmup // window))
    show = config.show_progress and rank == 0
    with progress(enabled=show) as bar:
        task = bar.add_task("race warm-up", total=len(arms) * warm_windows * window)
        for arm in arms:
            for _ in range(warm_windows * window):
                step(arm.name)
                bar.advance(task)
        bar.remove_task(task)
        rounds = race_rounds([a.name for a in arms], COMM_OPT, step, window, config, device, bar)
    for _, runtime, _ in runners.values():
        runtime.close()
    if rank != 0 and not every_rank:
        return None
    return rounds.record([(a.name, a.predicted_s) for a in arms], config)


def run_kfac_race(config: RaceConfig) -> RaceRecord | None:
    """Race the K-FAC finalists of the one plan in `config.plans` on `config.nproc` local workers (or torchrun's
    group); the result on rank 0, None on the other torchrun ranks."""
    (plan,) = config.plans
    if plan.kfac is None:
        raise PlanMismatchError("the plan has no kfac section; make one with `planner solve PROFILE --strategy kfac`")
    if plan.cluster.world_size != config.nproc:
        raise PlanMismatchError(f"the plan was made for world size {plan.cluster.world_size}, but --nproc is "
                                f"{config.nproc}; re-plan: {plan.replan_command()}")
    module = build_workload(config.model, batch_size=config.batch_size).module
    plan.check_compatible(model_info(module, config.model), config.nproc)
    plan.kfac.check_layers(kfac_layers(module, plan.kfac.skip))  # the layers it was profiled with
    if COMM_OPT not in {arm.name for arm in kfac_finalists(plan)}:
        raise PlanMismatchError("the plan's reference layouts could not be rebuilt from it (no COMM_OPT layout); "
                                "solve it again with `planner solve PROFILE --strategy kfac`")
    return launch.run_job(kfac_race_worker, config.nproc, config, backend=bench_backend(config.plans),
                          link=config.link, slowdown=config.slowdown, hosts=config.hosts)
