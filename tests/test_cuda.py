"""The GPU path: the runtime and the benches on CUDA tensors over nccl, against the same work on the CPU over gloo.

NCCL refuses two ranks of one communicator on one GPU, so one GPU gives a world of one: these tests check the
device handling (buffers, streams, the collectives' device, timing) rather than communication between GPUs.
They are skipped where no GPU is visible. The refusals around nccl run everywhere.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from planner.contracts.plan import Plan
from planner.platform.launch import check_gpus, run_distributed
from planner.runtime import GradientExchange, KFACPreconditioner
from planner.sessions.bench import LOCAL, BenchConfig, bench_backend, refuse_gpu_plans, run_bench
from planner.sessions.bench_kfac import KFACBenchConfig, run_kfac_bench
from planner.types import DistributedError, InverseMethod, PlanMismatchError, Strategy
from tests.factories import synthetic_kfac_plan, synthetic_plan
from tests.test_kfac_runtime import DAMPING, LR, SKIP, build_knet, full_batch
from tests.test_runtime import build_model, loss_of, make_batch, make_plan

pytestmark = pytest.mark.spawns  # its tests start their own workers (tests/pool.py says which must)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: GPU against CPU, float32 with TF32 off: the kernels sum in other orders. Gradients after three SGD steps.
RTOL, ATOL = 1e-4, 1e-5
#: K-FAC amplifies those differences by up to 1/damping through the eigendecompositions (another library's
#: eigh on each side), hence looser.
KFAC_RTOL, KFAC_ATOL = 2e-3, 2e-4


def on_gpus(plan: Plan, world_size: int = 1) -> Plan:
    """`plan` as if profiled on `world_size` GPUs."""
    return replace(plan, cluster=replace(plan.cluster, backend="nccl", device="GPU (test)", world_size=world_size))


def _exact_kernels() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _exchange_worker(rank: int, world_size: int, device_name: str) -> dict[str, list[np.ndarray]]:
    """Three SGD steps of each model through the exchange on `device_name`: the gradients after each exchange."""
    _exact_kernels()
    device = torch.device(device_name)
    out: dict[str, list[np.ndarray]] = {}
    for kind in ("mlp", "cnn", "tied", "frozen-bn"):
        for strategy, density in (("dense", None), ("topk", 1.0), ("topk", 0.1)):
            model = build_model(kind).to(device)
            plan = make_plan(model, "mixed", Strategy(strategy), density, world_size=world_size)
            if device.type == "cuda":  # the runtime refuses a plan made on another backend
                plan = on_gpus(plan, world_size)
            exchange = GradientExchange(model, plan)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            grads = []
            for step in range(3):
                x, y = make_batch(kind, rank, step)
                opt.zero_grad()
                loss_of(kind, model(x.to(device)), y.to(device)).backward()
                exchange.synchronize()
                grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
                             .cpu().numpy())
                opt.step()
            exchange.close()
            out[f"{kind} {strategy} {density}"] = grads
    return out


@needs_gpu
def test_the_exchange_on_a_gpu_gives_the_cpus_gradients() -> None:
    cpu = run_distributed(_exchange_worker, 1, "cpu", backend="gloo")[0]
    gpu = run_distributed(_exchange_worker, 1, "cuda", backend="nccl")[0]
    assert cpu.keys() == gpu.keys()
    for name, steps in cpu.items():
        for step, (want, got) in enumerate(zip(steps, gpu[name], strict=True)):
            if name.endswith("0.1"):
                # top-k at 0.1: an element whose value ties the k-th within rounding may be picked on one
                # device and not the other; everything else must agree
                close = np.isclose(got, want, rtol=RTOL, atol=ATOL)
                assert close.mean() > 0.99, f"{name} step {step}: {1 - close.mean():.2%} of elements differ"
                assert np.count_nonzero(got) == np.count_nonzero(want), f"{name} step {step}: other k"
            else:
                np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"{name} step {step}")


def _kfac_worker(rank: int, world_size: int, device_name: str, method: str) -> list[dict[str, np.ndarray]]:
    """Three K-FAC steps of the test network on `device_name`: the preconditioned gradients after each."""
    _exact_kernels()
    device = torch.device(device_name)
    model = build_knet().to(device)
    precond = KFACPreconditioner(model, skip_layers=SKIP, lr=LR, damping=DAMPING, kl_clip=None,
                                 method=InverseMethod(method))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    out = []
    with precond:
        for step in range(3):
            x, y = full_batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x.to(device)), y.to(device)).backward()
            precond.step()
            out.append({n: p.grad.cpu().numpy() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
    return out


@needs_gpu
@pytest.mark.parametrize("method", [InverseMethod.EIGEN, InverseMethod.INVERSE])
def test_kfac_on_a_gpu_gives_the_cpus_preconditioned_gradients(method: InverseMethod) -> None:
    cpu = run_distributed(_kfac_worker, 1, "cpu", method.value, backend="gloo")[0]
    gpu = run_distributed(_kfac_worker, 1, "cuda", method.value, backend="nccl")[0]
    for step, (want, got) in enumerate(zip(cpu, gpu, strict=True)):
        assert want.keys() == got.keys()
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=KFAC_RTOL, atol=KFAC_ATOL,
                                       err_msg=f"{method.value} step {step} {name}")


@needs_gpu
def test_the_benches_run_a_plan_made_on_a_gpu_there() -> None:
    plans = (on_gpus(synthetic_plan("mlp", 1)), on_gpus(synthetic_plan("mlp", 1, Strategy.TOPK, 0.01)))
    results = run_bench(BenchConfig(plans=plans, model="mlp", nproc=1, steps=3, warmup=1, block=1,
                                    show_progress=False))
    assert results is not None
    names = [r.name for r in results]
    assert names[0] == "ddp" and LOCAL in names and len(names) >= 4
    assert all(r.median_s > 0 and r.steps == 3 for r in results)
    kfac = on_gpus(synthetic_kfac_plan("mlp", 1))
    rows = run_kfac_bench(KFACBenchConfig(plan=kfac, model="mlp", nproc=1, steps=2, show_progress=False,
                                          peer=False))
    assert rows is not None and all(r.median_s > 0 for r in rows)
    assert {"sgd", "plan"} <= {r.name for r in rows}


@needs_gpu
def test_more_nccl_workers_than_gpus_are_refused_in_one_line() -> None:
    n = torch.cuda.device_count() + 1
    with pytest.raises(DistributedError, match=rf"backend nccl needs a GPU per worker, and {n} workers"):
        run_distributed(_exchange_worker, n, "cuda", backend="nccl")


# -- everywhere: refusals -------------------------------------------------------------------------


def test_nccl_workers_beyond_the_gpus_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_gpus("nccl", 1)
    check_gpus("gloo", 8)
    with pytest.raises(DistributedError, match=r"2 workers would share 1 GPU: use --nproc 1 or fewer, or --backend"):
        check_gpus("nccl", 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(DistributedError, match=r"share 0 GPUs"):
        run_distributed(_exchange_worker, 1, "cuda", backend="nccl")  # refused before any worker starts


def test_the_bench_runs_on_the_backend_the_plan_was_made_on(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = synthetic_plan("mlp", 2)
    assert bench_backend((cpu, cpu)) == "gloo"
    with pytest.raises(PlanMismatchError, match=r"different backends \(gloo, nccl\)"):
        bench_backend((cpu, on_gpus(cpu, 2)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PlanMismatchError, match=r"made on GPUs \(backend nccl\), and no GPU is visible here: .*"
                                                 r"planner (solve|profile)"):
        bench_backend((on_gpus(cpu, 2),))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DistributedError, match=r"2 workers would share 1 GPU: bench it where it was profiled"):
        bench_backend((on_gpus(cpu, 2),))


def test_benches_that_run_on_the_cpu_only_refuse_a_plan_made_on_gpus() -> None:
    cpu = synthetic_plan("mlp", 2)
    refuse_gpu_plans([cpu], "--strategy abs")
    with pytest.raises(PlanMismatchError, match=r"^--strategy abs runs its workers on the CPU \(gloo\) only, and the "
                                                r"plan was made on GPUs \(backend nccl\): on GPUs, bench step times"):
        refuse_gpu_plans([cpu, on_gpus(cpu, 2)], "--strategy abs")
