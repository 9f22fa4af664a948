"""A plan inside DDP (`planner.runtime.ddp_plan`): DDP's buckets are the plan's groups, and its hook averages as plain
DDP (dense), as PyTorch's fp16 hook (fp16) and as `GradientExchange` (every compressor), in real gloo processes.

Worker functions are module-level (the spawned processes import this module); each distributed test runs several
configurations in one `run_distributed` call to keep process start-up cheap.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from planner.contracts.layers import gradient_layers
from planner.contracts.plan import Group, Plan
from planner.contracts.unused import UnusedParams
from planner.costmodel.problem import groups_for, topk_count
from planner.runtime import GradientExchange, PlanHook
from planner.runtime.ddp_plan import bucket_caps
from planner.types import Compressor, PlanMismatchError, Strategy
from tests.factories import plan_with_groups, synthetic_kfac_plan
from tests.pool import run_warm
from tests.test_mixed_runtime import ShapedConv, mixed_plan
from tests.test_runtime import AuxHead, build_model, loss_of, make_batch

MISMATCH = "DDP's buckets are not the plan's groups"
#: DGC momentum correction's m in the tests of the hook's momentum.
MOMENTUM = 0.9


def ladder() -> nn.Module:
    """Eight linear layers of different widths (so groups of the same number of layers differ in bytes)."""
    torch.manual_seed(0)
    widths = [8, 24, 16, 40, 12, 32, 20, 28, 4]
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def uneven_plan(model: nn.Module, ends: tuple[int, ...], ready: list[str] | None = None, *,
                world_size: int = 2) -> Plan:
    """A dense plan whose groups end after the given layers of the ready order (`ready`: the layers' names;
    default reversed registration)."""
    layers = gradient_layers(model)[::-1]
    if ready is not None:
        by_name = {spec.name: spec for spec in layers}
        layers = [by_name[n] for n in ready]
    return plan_with_groups(model, groups_for(layers, ends, Strategy.DENSE, None), world_size=world_size)


def _step_both(rank: int, step: int, ddp: nn.Module, twin: nn.Module, exchange: GradientExchange,
               opts: list[torch.optim.SGD], label: str = "") -> None:
    """One step of DDP with the hook and of the twin with GradientExchange on the same batch; their parameters
    must then be equal bit for bit."""
    x, y = _ladder_batch(rank, step)
    for opt in opts:
        opt.zero_grad()
    nn.functional.mse_loss(ddp(x), y).backward()
    nn.functional.mse_loss(twin(x), y).backward()
    exchange.synchronize()
    for opt in opts:
        opt.step()
    for (pname, p), q in zip(ddp.module.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), f"{label}step {step}: {pname} differs by {(p - q).abs().max().item():.3g}"


def _ladder_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


# -- the caps, against DDP's own assignment (one process) ------------------------------------------------------


@pytest.mark.parametrize("sizes", [[[40, 4, 400], [4], [8, 8, 8, 8]], [[1000, 4], [4, 1000], [12]],
                                   [[4, 4, 4], [256, 4, 64, 4], [1]]])
def test_caps_make_ddps_assignment_close_one_bucket_per_group(sizes: list[list[int]]) -> None:
    """DDP's own assignment (`_compute_bucket_assignment_by_size`, the rule of its reducer) with the caps closes one
    bucket per group, whatever order each group's parameters arrive in."""
    caps = [int(c * (1 << 20)) for c in bucket_caps([[4 * n for n in run] for run in sizes])]  # as DDP reads them
    want, at = [], 0
    for run in sizes:
        want.append(list(range(at, at + len(run))))
        at += len(run)
    for within in (list, lambda run: list(reversed(run))):
        order = [torch.empty(n) for run in sizes for n in within(run)]
        got, _ = dist._compute_bucket_assignment_by_size(order, caps, [False] * len(order))
        assert got == want


# -- refusals (one process) -------------------------------------------------------------------------------------


def test_unsupported_plans_are_refused_in_one_line() -> None:
    model = ladder()
    kfac = synthetic_kfac_plan("mlp", world_size=1)
    with pytest.raises(PlanMismatchError) as info:
        PlanHook(model, kfac)
    message = str(info.value)
    assert "\n" not in message and "K-FAC" in message
    assert "dense, fp16, PowerSGD and top-k" in message and "GradientExchange" in message


def test_bad_inputs_are_refused_in_one_line(tmp_path: object) -> None:
    model = ladder()
    hook = PlanHook(model, uneven_plan(model, (3, 8), world_size=1))
    failures = []
    for call, error in ((lambda: hook.register(model), TypeError),
                        (lambda: hook.load_state_dict({"kind": "runtime.gradient_exchange"}), PlanMismatchError),
                        (lambda: hook.load_state_dict({**hook.state_dict(), "model_fingerprint": "x"}),
                         PlanMismatchError),
                        (lambda: PlanHook.from_file(model, f"{tmp_path}/missing.json"), OSError)):
        with pytest.raises(error) as info:
            call()
        failures.append(str(info.value))
    assert all("\n" not in m for m in failures), failures
    assert "DistributedDataParallel(model, **hook.ddp_kwargs())" in failures[0]
    assert "not a PlanHook state" in failures[1] and "fingerprint" in failures[2] and "missing.json" in failures[3]


def test_hook_state_entries_of_another_type_or_shape_are_refused_in_one_line() -> None:
    """Each bucket's entry is checked when loaded, as GradientExchange's (one checker): a residual that is a list
    (taken before, to fail inside DDP's backward), a buffer of another size, unknown parameters, PowerSGD's state
    apart or its Q of another size are one PlanMismatchError line each, and the state loaded before stays."""
    from planner.kernels.compress import PowerSGDLayout

    model = ladder()
    plan = mixed_plan(model, ["powersgd:1", "topk:0.3"], world_size=1)
    hook = PlanHook(model, plan)
    names = list(plan.groups[0].params)
    shapes = dict(model.named_parameters())
    numel = plan.groups[0].numel
    q_numel = PowerSGDLayout.of([shapes[n].shape for n in names], 1).q_numel
    good = {"params": names, "error": torch.ones(numel), "q": torch.ones(q_numel), "fresh": False}
    base = {**hook.state_dict(), "buckets": {0: good}}
    hook.load_state_dict(base)
    bad = [
        ([], "buckets must be a dict by index"),
        ({0: [good]}, "bucket 0's state must be a dict"),
        ({0: {"params": names, "residual": [0.0] * numel}}, "bucket 0's residual must be a tensor"),
        ({0: {"params": names, "residual": torch.zeros(numel + 1)}}, f"1-D floating tensor of {numel} elements"),
        ({0: {"params": ["ghost.weight"], "residual": torch.zeros(3)}}, "not this model's planned parameters"),
        ({0: {"params": names, "error": torch.zeros(numel)}}, "error, q and fresh together"),
        ({0: {**good, "q": torch.zeros(q_numel + 1)}}, f"q must be a 1-D floating tensor of {q_numel} elements"),
        ({0: {**good, "fresh": "no"}}, "fresh must be True or False"),
        ({0: {**good, "extra": 1}}, "holds \\['extra'\\]"),
    ]
    for buckets, words in bad:
        with pytest.raises(PlanMismatchError, match=words) as info:
            hook.load_state_dict({**base, "buckets": buckets})
        assert "\n" not in str(info.value), words
    assert torch.equal(hook._pending[0]["q"], good["q"])


def test_without_a_cap_list_ddp_gets_the_median_cap_and_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    from planner.runtime import ddp_plan

    model = ladder()
    hook = PlanHook(model, uneven_plan(model, (3, 5, 6, 8), world_size=1))
    caps = hook.ddp_kwargs()["bucket_cap_mb_list"]
    assert len(caps) == 4
    monkeypatch.setattr(ddp_plan, "_has_cap_list", lambda: False)
    with pytest.warns(RuntimeWarning, match="no bucket_cap_mb_list") as caught:
        kwargs = hook.ddp_kwargs()
    middle = sorted(caps)[1:3]
    assert "bucket_cap_mb_list" not in kwargs and kwargs["bucket_cap_mb"] == (middle[0] + middle[1]) / 2
    assert "\n" not in str(caught[0].message)


# -- distributed: buckets, dense, fp16, every compressor --------------------------------------------------------


def _buckets_worker(rank: int, world_size: int) -> list[str]:
    """DDP built with `ddp_kwargs()` lays out the plan's groups exactly (after its rebuild, or at once with
    find_unused_parameters), and its dense hook steps the parameters bit for bit as plain DDP."""
    cases = [
        ("ladder", ladder, uneven_plan(ladder(), (3, 5, 6, 8))),
        ("tied", lambda: build_model("tied"), uneven_plan(build_model("tied"), (1, 3))),
        # registered head, bn, conv (the stem frozen); ready head, conv, bn
        ("frozen-bn", lambda: build_model("frozen-bn"), uneven_plan(build_model("frozen-bn"), (1, 3),
                                                                    ["head", "conv", "bn"])),
    ]
    aux = AuxHead()
    aux_plan = uneven_plan(aux, (2, 3))  # aux and head, then trunk (aux is never used)
    aux_plan = replace(aux_plan, unused_params=UnusedParams(batches=4, never=("aux.weight", "aux.bias")))
    cases.append(("aux", lambda: (torch.manual_seed(0), AuxHead())[1], aux_plan))
    cases.append(("ladder-static", ladder, uneven_plan(ladder(), (2, 3, 7, 8))))
    done = []
    for name, make, plan in cases:
        model = make()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            static = name.endswith("static")
            hook = PlanHook(model, plan, find_unused_parameters=True if name.startswith("aux") else None)
            if name == "aux":  # the plan records unused parameters: DDP without find_unused_parameters is refused
                other = copy.deepcopy(model)
                with pytest.raises(PlanMismatchError, match="find_unused_parameters=False"):
                    PlanHook(other, plan, find_unused_parameters=True).register(DistributedDataParallel(other))
            kwargs = hook.ddp_kwargs(static_graph=static)
            ddp = DistributedDataParallel(model, **kwargs)
            hook.register(ddp)
            ref = DistributedDataParallel(make(), find_unused_parameters=kwargs["find_unused_parameters"],
                                          static_graph=static)
            opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ddp, ref)]
            for step in range(4):
                if name.startswith("ladder"):
                    x, y = _ladder_batch(rank, step)
                    losses = [nn.functional.mse_loss(m(x), y) for m in (ddp, ref)]
                elif name.startswith("aux"):
                    x, y = _ladder_batch(rank, step)
                    x, y = x[:, :8], y
                    losses = [nn.functional.mse_loss(m(x), y) for m in (ddp, ref)]
                else:
                    x, y = make_batch(name, rank, step)
                    losses = [loss_of(name, m(x), y) for m in (ddp, ref)]
                for opt in opts:
                    opt.zero_grad()
                for loss in losses:
                    loss.backward()
                for opt in opts:
                    opt.step()
                for (pname, p), q in zip(ddp.module.named_parameters(), ref.module.parameters(), strict=True):
                    assert torch.equal(p, q), f"{name} step {step}: {pname} differs from plain DDP by " \
                        f"{(p - q).abs().max().item():.3g}"
        assert not [w for w in caught if MISMATCH in str(w.message)], f"{name}: {[str(w.message) for w in caught]}"
        assert [set(b) for b in hook.buckets] == [set(g.params) for g in plan.groups], f"{name}: {hook.buckets}"
        assert hook.bucket_groups == list(range(len(plan.groups)))
        done.append(name)
    return done


def test_ddp_buckets_are_the_plans_groups_and_dense_equals_plain_ddp() -> None:
    assert run_warm(_buckets_worker, 2) == [["ladder", "tied", "frozen-bn", "aux", "ladder-static"]] * 2


SENT_AS = ["powersgd:2", "topk:0.3", "fp16", "dense"]


def _compressors_worker(rank: int, world_size: int) -> list[str]:
    """Every compressor in one plan against `GradientExchange` with the same plan, over several SGD steps (after
    the hook's warm-up iteration, taken without a step): the same arithmetic on the same local gradients, so
    equal to fp32 rounding (rtol 1e-6, atol 1e-7; in practice bit for bit). Then the hook's state resumes: a new
    DDP and hook loaded with it continue as the original does."""
    model = ladder()
    plan = mixed_plan(model, SENT_AS)
    twin = copy.deepcopy(model)
    hook = PlanHook(model, plan)
    ddp = DistributedDataParallel(model, **hook.ddp_kwargs())
    hook.register(ddp)
    x, y = _ladder_batch(rank, 99)
    nn.functional.mse_loss(ddp(x), y).backward()  # the warm-up iteration, no step
    exchange = GradientExchange(twin, plan)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ddp, twin)]

    def step_both(step: int) -> None:
        x, y = _ladder_batch(rank, step)
        for opt in opts:
            opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        nn.functional.mse_loss(twin(x), y).backward()
        exchange.synchronize()
        for opt in opts:
            opt.step()
        for (pname, p), q in zip(ddp.module.named_parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"step {step}: {pname}")

    for step in range(4):
        step_both(step)
    assert hook.bucket_groups == list(range(len(plan.groups)))
    # resume: a fresh DDP and hook on a copy, loaded with the state, after their own warm-up iteration
    saved = hook.state_dict()
    resumed_model = copy.deepcopy(ddp.module)
    resumed = PlanHook(resumed_model, plan)
    resumed.load_state_dict(saved)
    resumed_ddp = DistributedDataParallel(resumed_model, **resumed.ddp_kwargs())
    resumed.register(resumed_ddp)
    nn.functional.mse_loss(resumed_ddp(x), y).backward()  # warm-up, no step
    resumed_opt = torch.optim.SGD(resumed_ddp.parameters(), lr=0.05)
    for step in range(4, 7):
        x, y = _ladder_batch(rank, step)
        resumed_opt.zero_grad()
        nn.functional.mse_loss(resumed_ddp(x), y).backward()
        resumed_opt.step()
        step_both(step)
        for (pname, p), q in zip(resumed_model.named_parameters(), ddp.module.parameters(), strict=True):
            assert torch.equal(p, q), f"resumed step {step}: {pname} differs by {(p - q).abs().max().item():.3g}"
    exchange.close()
    return sorted({str(plan.compressor_of(g)) for g in plan.groups})


def test_every_compressor_equals_gradient_exchange_and_resumes() -> None:
    assert run_warm(_compressors_worker, 2) == [sorted(SENT_AS)] * 2


def _mismatch_worker(rank: int, world_size: int) -> list[str]:
    """DDP built with its own buckets (one bucket here): one warning, in one line, naming the bucket, at the first
    iteration of the final layout; none after. The bucket is sent as the group holding most of its elements: the
    ladder's largest layer (16 x 40), a dense group, so the gradients equal plain DDP's bit for bit (the fp16
    groups' compressor would not)."""
    model = ladder()
    plan = mixed_plan(model, ["fp16", "dense"])
    largest = max(range(len(plan.groups)), key=lambda i: plan.groups[i].numel)
    assert plan.groups[largest].params == ("4.weight", "4.bias") and str(plan.compressor_of(plan.groups[largest])) \
        == "dense"
    hook = PlanHook(model, plan)
    ddp = DistributedDataParallel(model)  # not **hook.ddp_kwargs()
    hook.register(ddp)
    ref = DistributedDataParallel(ladder())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            x, y = _ladder_batch(rank, step)
            for m in (ddp, ref):
                m.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
            for (pname, p), q in zip(ddp.module.named_parameters(), ref.module.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad), \
                    f"step {step}: {pname}"
    messages = [str(w.message) for w in caught if MISMATCH in str(w.message)]
    assert hook.bucket_groups == [None]
    return messages


def test_buckets_that_differ_from_the_plan_warn_once_in_one_line() -> None:
    for messages in run_warm(_mismatch_worker, 2):
        assert len(messages) == 1, messages
        assert "\n" not in messages[0] and "bucket 0" in messages[0] and "ddp_kwargs" in messages[0]


# -- hierarchical groups (4 processes as 2 hosts of 2) ----------------------------------------------------------

HIERARCHICAL_AS = ["dense", "fp16", "powersgd:2", "topk:0.3"]
HOSTS = [[0, 1], [2, 3]]


def hierarchical_plan(model: nn.Module, hierarchical: list[bool]) -> Plan:
    """`mixed_plan(model, HIERARCHICAL_AS)` for 4 workers on 2 hosts, group i hierarchical where
    hierarchical[i % len]. Each layer's parameters are listed bias first, the order their gradients become ready
    and so DDP's bucket's: GradientExchange lays out its buffer in the plan's order, and over 4 ranks gloo's
    allreduce adds an element's values in an order that depends on its position (fp16 rounds differently)."""
    plan = mixed_plan(model, HIERARCHICAL_AS, world_size=4)
    groups = tuple(replace(g, params=g.params[::-1], hierarchical=hierarchical[i % len(hierarchical)])
                   for i, g in enumerate(plan.groups))
    return replace(plan, groups=groups, cluster=replace(plan.cluster, host_count=2))


def _hierarchical_worker(rank: int, world_size: int, explicit: bool, momentum: float = 0.0) -> list[tuple[str, bool]]:
    """The ladder's eight groups, every compressor hierarchical, dense and top-k flat too, against
    `GradientExchange` on the same hosts over four SGD steps (after the hook's warm-up iteration): the same kernels
    on the same buffers in the same order, so bit for bit. The hosts are given (`explicit`), or read from the
    ranks' host names. With `momentum`, both apply it (momentum correction, SGD without). Returns the groups'
    (compressor, hierarchical)."""
    hosts = HOSTS if explicit else None
    model = ladder()
    plan = hierarchical_plan(model, [True, True, True, False, False])
    twin = copy.deepcopy(model)
    if explicit:  # DDP over another group than the one the host groups were made for is refused
        other = copy.deepcopy(model)
        with pytest.raises(PlanMismatchError, match="another process group"):
            PlanHook(other, plan, hosts=HOSTS).register(
                DistributedDataParallel(other, process_group=dist.new_group(list(range(world_size)))))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, twin)]
    options = [{"momentum": momentum, "optimizer": opt} if momentum else {} for opt in opts]
    hook = PlanHook(model, plan, hosts=hosts, **options[0])
    ddp = DistributedDataParallel(model, **hook.ddp_kwargs())
    hook.register(ddp)
    x, y = _ladder_batch(rank, 99)
    nn.functional.mse_loss(ddp(x), y).backward()  # the warm-up iteration, no step
    exchange = GradientExchange(twin, plan, hosts=hosts, **options[1])
    for step in range(4):
        _step_both(rank, step, ddp, twin, exchange, opts)
    assert hook.bucket_groups == list(range(len(plan.groups)))
    assert [r.hierarchical for r in hook._routes.values()] == [g.hierarchical for g in plan.groups]
    exchange.close()
    return [(str(plan.compressor_of(g)), g.hierarchical) for g in plan.groups]


def test_hierarchical_groups_equal_gradient_exchange_on_two_hosts_bit_for_bit() -> None:
    """Four workers of this machine as the two hosts given to both."""
    sent = run_warm(_hierarchical_worker, 4, True, timeout=180)[0]
    assert {c for c, h in sent if h} == set(HIERARCHICAL_AS) and {c for c, h in sent if not h} == {
        "dense", "topk:0.3"}


def test_hierarchical_groups_with_momentum_equal_gradient_exchange_bit_for_bit() -> None:
    assert len(run_warm(_hierarchical_worker, 4, True, MOMENTUM, timeout=180)) == 4


# (On emulated hosts found by name: tests/test_hierarchical.py, in one launch with the collectives and the runtime.)


# -- models shaped like real ones (2 processes) ------------------------------------------------------------------


def named_plan(model: nn.Module, groups: list[list[str]], sent_as: list[str], *,
               never: tuple[str, ...] = (), sometimes: tuple[str, ...] = ()) -> Plan:
    """A plan of the given groups of parameter names, group i sent as sent_as[i % len], recording `never` and
    `sometimes` as parameters its profile saw no gradient for in every batch or in some."""
    params = dict(model.named_parameters())
    made = []
    for i, names in enumerate(groups):
        compressor = Compressor.parse(sent_as[i % len(sent_as)])
        numel = sum(params[n].numel() for n in names)
        made.append(Group(layers=tuple(dict.fromkeys(n.rsplit(".", 1)[0] for n in names)), params=tuple(names),
                          numel=numel, compressor=compressor,
                          k=None if compressor.density is None else topk_count(numel, compressor.density)))
    plan = plan_with_groups(model, tuple(made), Strategy.MIXED)
    if never or sometimes:
        plan = replace(plan, unused_params=UnusedParams(batches=4, never=never, sometimes=sometimes))
    return plan


def shaped(case: str) -> nn.Module:
    """`ShapedConv` (tied weight, frozen layer, BatchNorm, registered in another order than used, an unused
    layer); "rebuilt": its unused layer frozen too, so DDP needs no find_unused_parameters and rebuilds."""
    torch.manual_seed(0)
    model = ShapedConv()
    if case == "rebuilt":
        model.unused.requires_grad_(False)
    return model


#: Per case: the plan's groups, in DDP's final layout's order (ready order when DDP rebuilds; registration order
#: with find_unused_parameters, where DDP keeps its first layout: the plan's order does not matter then).
SHAPED_GROUPS = {
    "unused": [["head.weight", "head.bias"], ["body.weight", "body.bias"], ["norm.weight", "norm.bias"],
               ["conv.weight", "conv.bias"], ["unused.weight", "unused.bias"]],
    "rebuilt": [["head.bias", "head.weight"], ["body.bias", "body.weight"], ["norm.weight", "norm.bias"],
                ["conv.weight", "conv.bias"]],
}
SHAPED_AS = ["powersgd:2", "topk:0.3", "fp16", "dense"]


def _shaped_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * rank + step)
    return torch.randn(4, 3, 6, 6, generator=g), torch.randn(4, 4, generator=g)


def _state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers (BatchNorm's running statistics, which DDP broadcasts from rank 0)."""
    return [*model.named_parameters(), *model.named_buffers()]


def _shaped_worker(rank: int, world_size: int) -> list[str]:
    """On `ShapedConv`, with and without its unused layer: a dense plan steps bit for bit as plain DDP, and a plan of
    every compressor as `GradientExchange` with the same plan (after the hook's warm-up iteration, where DDP
    rebuilds: taken on both without a step), parameters and buffers, over three steps of SGD with momentum."""
    done = []
    for case, groups in SHAPED_GROUPS.items():
        never = ("unused.weight", "unused.bias") if case == "unused" else ()
        for sent_as in (["dense"], SHAPED_AS):
            model = shaped(case)
            plan = named_plan(model, groups, sent_as, never=never)
            twin = copy.deepcopy(model)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                hook = PlanHook(model, plan)
                ddp = DistributedDataParallel(model, **hook.ddp_kwargs())
                hook.register(ddp)
                dense = sent_as == ["dense"]
                other: nn.Module = DistributedDataParallel(twin, find_unused_parameters=bool(never)) if dense else twin
                if hook._final_iteration == 1:  # the warm-up iteration (an fp32 mean), no step; BatchNorm counts it
                    x, y = _shaped_batch(rank, 99)
                    nn.functional.mse_loss(ddp(x), y).backward()
                    if dense:
                        nn.functional.mse_loss(other(x), y).backward()
                    else:
                        twin(x)
                exchange = None if dense else GradientExchange(twin, plan)
                opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ddp, other)]
                for step in range(3):
                    x, y = _shaped_batch(rank, step)
                    for opt in opts:
                        opt.zero_grad()
                    for m in (ddp, other):
                        nn.functional.mse_loss(m(x), y).backward()
                    if exchange is not None:
                        exchange.synchronize()
                    for opt in opts:
                        opt.step()
                    for (name, p), (_, q) in zip(_state(ddp.module), _state(twin), strict=True):
                        assert torch.equal(p, q), f"{case} {sent_as} step {step}: {name} differs by " \
                            f"{(p.float() - q.float()).abs().max().item():.3g}"
            assert not [w for w in caught if MISMATCH in str(w.message)], [str(w.message) for w in caught]
            # each bucket is one group (in registration order where DDP keeps its first layout)
            assert sorted(hook.bucket_groups) == list(range(len(plan.groups))), (case, hook.buckets)
            assert model.unused.weight.grad is None  # no rank used it: DDP leaves it as plain DDP does
            if exchange is not None:
                exchange.close()
            done.append(f"{case} {'+'.join(sent_as)}")
    return done


def test_models_shaped_like_real_ones_equal_plain_ddp_and_gradient_exchange() -> None:
    assert run_warm(_shaped_worker, 2) == [[f"{c} {s}" for c in SHAPED_GROUPS
                                                   for s in ("dense", "+".join(SHAPED_AS))]] * 2


# -- buckets that hold a group's parameters in another order than the plan (2 processes) -------------------------


class Seq2Seq(nn.Module):
    """A GRU encoder-decoder: two weight matrices per GRU layer, whose gradients become ready weight_hh first, so
    DDP's rebuilt buckets hold them in another order than the plan's groups (registration order)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.GRU(6, 12, batch_first=True)
        self.decoder = nn.GRU(6, 12, batch_first=True)
        self.head = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, state = self.encoder(x)
        out, _ = self.decoder(x.flip(1), state)
        return self.head(out[:, -1])


class Experts(nn.Module):
    """A tiny mixture of experts: each batch goes to the 2 of 4 experts its mean gate scores choose, so ranks leave
    different experts without a gradient on the same step (find_unused_parameters: DDP keeps registration order)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 16) for _ in range(4))
        self.head = nn.Linear(16, 4)

    def chosen(self, x: torch.Tensor) -> list[int]:
        return sorted(int(i) for i in torch.topk(self.gate(x).mean(0), 2).indices)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.gate(x).mean(0)
        chosen = torch.topk(scores, 2).indices
        weights = torch.softmax(scores[chosen], 0)
        hidden = sum(w * torch.tanh(self.experts[int(i)](x)) for w, i in zip(weights, chosen, strict=True))
        assert isinstance(hidden, torch.Tensor)
        return self.head(hidden)


def _expert_names(order: list[int]) -> list[str]:
    return [f"experts.{i}.{p}" for i in order for p in ("bias", "weight")]


#: Per model: its factory, the plan's groups (in ready order, each layer's bias first, where DDP holds them in
#: another order: GRU's weight_hh first after the rebuild, registration order with find_unused_parameters), the
#: parameters without a gradient in some batches, and a batch of (rank, step).
ORDER_CASES = {
    "gru": (Seq2Seq, [["head.bias", "head.weight"],
                      [f"decoder.{w}_l0" for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")],
                      [f"encoder.{w}_l0" for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]], ()),
    "moe": (Experts, [["head.bias", "head.weight"], _expert_names([3, 2, 1, 0]), ["gate.bias", "gate.weight"]],
            tuple(_expert_names([0, 1, 2, 3]))),
}
ORDER_AS = ["dense", "fp16", "powersgd:1", "powersgd:2", "topk:0.3"]


def test_powersgd_buffers_in_another_order_or_part_of_a_group_compute_each_tensor_as_the_group() -> None:
    """The kernel's rule behind the hook's buckets: a buffer holding a group's tensors in another order, or some of
    them (a group DDP splits), gives each tensor the group's own result bit for bit, on one worker over two steps
    (the first Qs drawn, then warm-started)."""
    from planner.kernels.compress import PowerSGDGroup, PowerSGDLayout

    shapes = [(12, 8), (12,), (20, 6), (16, 4, 3), (5, 3)]
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    grads = [[torch.randn(n, generator=torch.Generator().manual_seed(10 * step + i)) for i, n in enumerate(sizes)]
             for step in range(2)]

    def run(held: list[int]) -> list[torch.Tensor]:
        group = PowerSGDGroup(PowerSGDLayout.of(shapes, 2, held=held), torch.device("cpu"), seed=123)
        outs = []
        for step in range(2):
            group.compress(torch.cat([grads[step][i] for i in held]))
            group.middle(1)
            out = torch.empty(group.layout.numel)
            group.decompress(out, 1)
            outs.append(out)
        return [torch.cat([o, group.error]) for o in outs]

    def per_tensor(held: list[int], flats: list[torch.Tensor]) -> dict[tuple[int, int, str], torch.Tensor]:
        numel = sum(sizes[i] for i in held)
        found, at = {}, 0
        for i in held:
            for step, flat in enumerate(flats):
                found[(i, step, "out")] = flat[at : at + sizes[i]]
                found[(i, step, "error")] = flat[numel + at : numel + at + sizes[i]]
            at += sizes[i]
        return found

    whole = per_tensor([0, 1, 2, 3, 4], run([0, 1, 2, 3, 4]))
    for held in ([3, 1, 4, 0, 2], [2, 0], [4, 3, 1]):
        for key, value in per_tensor(held, run(held)).items():
            assert torch.equal(value, whole[key]), (held, key)
    with pytest.raises(ValueError, match="distinct indices"):
        PowerSGDLayout.of(shapes, 2, held=[0, 0])


def _order_batch(case: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * rank + step)
    if case == "gru":
        return torch.randn(4, 5, 6, generator=g), torch.randn(4, 4, generator=g)
    return torch.randn(6, 8, generator=g) + 2 * torch.randn(8, generator=g), torch.randn(6, 4, generator=g)


def _order_worker(rank: int, world_size: int, steps: int) -> dict[str, list[float]]:
    """Per model of ORDER_CASES and compressor of ORDER_AS (the whole plan sent by it): the hook against
    `GradientExchange` with the same plan over `steps` SGD steps (after DDP's warm-up iteration where it rebuilds,
    taken without a step). Returns, per case, the largest parameter difference after each step, and per model the
    experts each step chose on this rank ("moe chosen") and whether a bucket held its group in another order."""
    found: dict[str, list[float]] = {}
    for case, (make, groups, sometimes) in ORDER_CASES.items():
        for sent_as in ORDER_AS:
            model = make()
            plan = named_plan(model, groups, [sent_as], sometimes=sometimes)
            twin = copy.deepcopy(model)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # find_unused_parameters turned on by the plan
                hook = PlanHook(model, plan)
                ddp = DistributedDataParallel(model, **hook.ddp_kwargs())
                hook.register(ddp)
                if hook._final_iteration == 1:  # the warm-up iteration (an fp32 mean), no step
                    x, y = _order_batch(case, rank, 99)
                    nn.functional.mse_loss(ddp(x), y).backward()
                exchange = GradientExchange(twin, plan)
            opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, twin)]
            label = f"{case} {sent_as}"
            found[label] = []
            for step in range(steps):
                x, y = _order_batch(case, rank, step)
                if case == "moe":
                    found.setdefault("moe chosen", []).extend(twin.chosen(x))  # type: ignore[operator]
                for opt in opts:
                    opt.zero_grad()
                for m in (ddp, twin):
                    nn.functional.mse_loss(m(x), y).backward()
                exchange.synchronize()
                for opt in opts:
                    opt.step()
                found[label].append(max((p - q).abs().max().item()
                                        for p, q in zip(ddp.module.parameters(), twin.parameters(), strict=True)))
            exchange.close()
            assert sorted(hook.bucket_groups) == list(range(len(plan.groups))), (label, hook.buckets)
            found[f"{case} reordered"] = [float(any(names != plan.groups[i].params for names, i in zip(
                hook.buckets, hook.bucket_groups, strict=True) if i is not None))]
    return found


def test_buckets_in_another_order_than_the_plans_groups_equal_gradient_exchange_bit_for_bit() -> None:
    """A GRU encoder-decoder (DDP's rebuilt buckets hold weight_hh before weight_ih) and a mixture of experts whose
    ranks leave different experts unused (find_unused_parameters: DDP keeps registration order), every compressor:
    the hook's parameters equal the exchange's bit for bit (PowerSGD's Qs are drawn and packed in the group's order,
    whatever the bucket's). Two steps: PowerSGD's second starts from the first's Qs and errors."""
    results = run_warm(_order_worker, 2, 2)
    for found in results:
        assert found.pop("gru reordered") == [1.0] and found.pop("moe reordered") == [1.0]
    chosen = [found.pop("moe chosen") for found in results]
    assert len(chosen[0]) == 2 * 2 * len(ORDER_AS) and chosen[0] != chosen[1]  # the ranks' experts differ
    assert results == [{f"{case} {sent_as}": [0.0, 0.0] for case in ORDER_CASES for sent_as in ORDER_AS}] * 2


# -- static_graph with parameters that never get a gradient (2 processes) -----------------------------------------


class TwoAux(nn.Module):
    """A trunk and head the loss uses, and two auxiliary heads it never touches, registered between them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.aux_b = nn.Linear(16, 3)
        self.trunk = nn.Linear(8, 16)
        self.aux_a = nn.Linear(16, 5)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.trunk(x)))


#: head and aux_a (used beside never used), aux_b alone (never used, in the middle of the plan), trunk.
STATIC_GROUPS = [["head.bias", "head.weight", "aux_a.weight", "aux_a.bias"], ["aux_b.weight", "aux_b.bias"],
                 ["trunk.bias", "trunk.weight"]]


def _static_worker(rank: int, world_size: int) -> tuple[list[list[str]], list[int | None], list[str]]:
    """DDP with static_graph lays out the parameters that got no gradient last (in registration order); the caps
    follow, so the buckets are the used part of group 0, group 2, group 1 and the never-used part of group 0, with
    no warning, and the dense hook steps bit for bit as plain DDP with static_graph, `.grad` of the never-used
    parameters included. Returns the buckets, their groups and the warnings."""
    model = TwoAux()
    plan = named_plan(model, STATIC_GROUPS, ["dense"],
                      never=("aux_b.weight", "aux_b.bias", "aux_a.weight", "aux_a.bias"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hook = PlanHook(model, plan)
        ddp = DistributedDataParallel(model, **hook.ddp_kwargs(static_graph=True))
        hook.register(ddp)
        ref = DistributedDataParallel(TwoAux(), static_graph=True)
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ddp, ref)]
        for step in range(4):
            x, y = _ladder_batch(rank, step)
            for opt in opts:
                opt.zero_grad()
            for m in (ddp, ref):
                nn.functional.mse_loss(m(x), y).backward()
            for opt in opts:
                opt.step()
            for (name, p), q in zip(ddp.module.named_parameters(), ref.module.parameters(), strict=True):
                assert (p.grad is None) == (q.grad is None), f"step {step}: {name}"
                assert torch.equal(p, q), f"step {step}: {name} differs by {(p - q).abs().max().item():.3g}"
    return ([sorted(b) for b in hook.buckets], hook.bucket_groups,
            [str(w.message) for w in caught if issubclass(w.category, (RuntimeWarning, UserWarning))])


def test_static_graph_caps_put_never_used_parameters_last_as_ddp_does() -> None:
    for buckets, groups, messages in run_warm(_static_worker, 2):
        assert buckets == [["head.bias", "head.weight"], ["trunk.bias", "trunk.weight"],
                           ["aux_b.bias", "aux_b.weight"], ["aux_a.bias", "aux_a.weight"]]
        assert groups == [None, 2, 1, None]  # group 0 is two buckets, each sent as group 0
        # nor DDP's "find_unused_parameters=true ... `_set_static_graph` will detect unused parameters" warning
        assert not [m for m in messages if MISMATCH in m or "_set_static_graph" in m], messages


# -- accumulation under no_sync (2 processes) ---------------------------------------------------------------------


def _no_sync_worker(rank: int, world_size: int) -> list[int]:
    """Two micro-batches under `ddp.no_sync()`, then one synced: the dense hook steps bit for bit as plain DDP
    (from the first step: DDP's warm-up comes with the first synced backward), and a plan of every compressor as
    `GradientExchange.no_sync()` does (after the hook's warm-up iteration, taken without a step). The hook counts
    synced iterations only. Returns its iteration counts."""
    counts = []
    for sent_as in (["dense"], SENT_AS):
        model = ladder()
        plan = mixed_plan(model, sent_as)
        twin = copy.deepcopy(model)
        hook = PlanHook(model, plan)
        ddp = DistributedDataParallel(model, **hook.ddp_kwargs())
        hook.register(ddp)
        dense = sent_as == ["dense"]
        other: nn.Module = DistributedDataParallel(twin) if dense else twin
        if not dense:  # the hook's warm-up iteration, no step
            x, y = _ladder_batch(rank, 99)
            nn.functional.mse_loss(ddp(x), y).backward()
            ddp.zero_grad()
        exchange = None if dense else GradientExchange(twin, plan)
        quiet = [ddp.no_sync, other.no_sync if exchange is None else exchange.no_sync]
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ddp, other)]
        before = hook.iteration
        for step in range(3):
            for opt in opts:
                opt.zero_grad()
            for micro in range(3):
                x, y = _ladder_batch(rank, 10 * step + micro)
                for m, no_sync in zip((ddp, other), quiet, strict=True):
                    if micro < 2:
                        with no_sync():
                            nn.functional.mse_loss(m(x), y).backward()
                    else:
                        nn.functional.mse_loss(m(x), y).backward()
                if micro < 2:
                    assert hook.iteration == before + step, "a backward under no_sync was sent"
            if exchange is not None:
                exchange.synchronize()
            for opt in opts:
                opt.step()
            for (name, p), q in zip(ddp.module.named_parameters(), twin.parameters(), strict=True):
                assert torch.equal(p, q), f"{sent_as} step {step}: {name} differs by {(p - q).abs().max().item():.3g}"
        assert hook.bucket_groups == list(range(len(plan.groups)))
        counts.append(hook.iteration)
        if exchange is not None:
            exchange.close()
    return counts


def test_no_sync_accumulation_equals_plain_ddp_and_gradient_exchange() -> None:
    assert run_warm(_no_sync_worker, 2) == [[3, 4]] * 2  # synced iterations (and the warm-up) only


# -- momentum correction (DGC), as GradientExchange's ----------------------------------------------------------


def test_momentum_options_and_optimizers_are_refused_as_gradient_exchange_does_in_one_line() -> None:
    """PlanHook takes momentum, nesterov and optimizer with GradientExchange's checks, worded for the hook; the
    optimizer is checked again at each step, and a state with velocities is refused by a hook without momentum."""
    model = ladder()
    topk, dense = mixed_plan(model, ["topk:0.3"], world_size=1), mixed_plan(model, ["dense"], world_size=1)

    def sgd(momentum: float) -> torch.optim.SGD:
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)

    refused = [
        (lambda: PlanHook(model, topk, momentum=1.0, optimizer=sgd(0)), ValueError, "0 <= momentum < 1"),
        (lambda: PlanHook(model, topk, nesterov=True), ValueError, "nesterov=True needs momentum > 0"),
        (lambda: PlanHook(model, topk, momentum=MOMENTUM), ValueError, "needs optimizer="),
        (lambda: PlanHook(model, dense, momentum=MOMENTUM, optimizer=sgd(0.5)), ValueError, "applied twice"),
        (lambda: PlanHook(model, topk, optimizer=sgd(0.5)), ValueError, "pass momentum=0.5 to PlanHook"),
    ]
    messages = []
    for call, error, words in refused:
        with pytest.raises(error, match=words) as info:
            call()
        messages.append(str(info.value))
    PlanHook(model, dense, optimizer=sgd(0.5))  # dense groups keep the optimizer's momentum, as GradientExchange's
    opt = sgd(0)
    hook = PlanHook(model, topk, momentum=MOMENTUM, optimizer=opt)
    opt.param_groups[0]["momentum"] = 0.5  # turned on after construction: refused at the step
    with pytest.raises(ValueError, match="applied twice") as info:
        opt.step()
    messages.append(str(info.value))
    hook.remove_hooks()
    opt.step()  # the hook no longer checks it
    saved = {**hook.state_dict(), "buckets": {0: {"params": list(topk.groups[0].params),
                                                  "velocity": torch.zeros(topk.groups[0].numel)}}}
    with pytest.raises(PlanMismatchError, match="momentum=0") as info:
        PlanHook(model, topk).load_state_dict(saved)
    messages.append(str(info.value))
    assert all("\n" not in m and "GradientExchange" not in m and "the exchange" not in m for m in messages), messages


def _momentum_worker(rank: int, world_size: int) -> list[str]:
    """DGC momentum correction in the hook against `GradientExchange(momentum=0.9)` with the same plan, plain and
    Nesterov, on a top-k plan and one of every compressor: SGD without momentum steps both, four steps after the
    hook's warm-up iteration (taken without a step: the hook applies no momentum there). The same kernels on the same
    local gradients, so bit for bit. Then the hook's state (velocities with residuals and PowerSGD's) resumes a new
    DDP and hook bit for bit."""
    done = []
    for sent_as, nesterov in itertools.product((["topk:0.3"], SENT_AS), (False, True)):
        model = ladder()
        plan = mixed_plan(model, sent_as)
        twin = copy.deepcopy(model)
        opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, twin)]
        hook = PlanHook(model, plan, momentum=MOMENTUM, nesterov=nesterov, optimizer=opts[0])
        ddp = DistributedDataParallel(model, **hook.ddp_kwargs())
        hook.register(ddp)
        x, y = _ladder_batch(rank, 99)
        nn.functional.mse_loss(ddp(x), y).backward()  # the warm-up iteration, no step
        exchange = GradientExchange(twin, plan, momentum=MOMENTUM, nesterov=nesterov, optimizer=opts[1])
        label = f"{'+'.join(sent_as)}{' nesterov' if nesterov else ''}"

        def step_both(step: int, label: str = label, ddp: nn.Module = ddp, twin: nn.Module = twin,
                      exchange: GradientExchange = exchange, opts: list[torch.optim.SGD] = opts) -> None:
            _step_both(rank, step, ddp, twin, exchange, opts, f"{label} ")

        for step in range(4):
            step_both(step)
        assert hook.bucket_groups == list(range(len(plan.groups)))
        saved = hook.state_dict()
        assert all("velocity" in entry for entry in saved["buckets"].values()), label
        resumed_model = copy.deepcopy(ddp.module)
        resumed_opt = torch.optim.SGD(resumed_model.parameters(), lr=0.05)
        resumed = PlanHook(resumed_model, plan, momentum=MOMENTUM, nesterov=nesterov, optimizer=resumed_opt)
        resumed.load_state_dict(saved)
        resumed_ddp = DistributedDataParallel(resumed_model, **resumed.ddp_kwargs())
        resumed.register(resumed_ddp)
        nn.functional.mse_loss(resumed_ddp(x), y).backward()  # warm-up, no step
        for step in range(4, 7):
            x, y = _ladder_batch(rank, step)
            resumed_opt.zero_grad()
            nn.functional.mse_loss(resumed_ddp(x), y).backward()
            resumed_opt.step()
            step_both(step)
            for (pname, p), q in zip(resumed_model.named_parameters(), ddp.module.parameters(), strict=True):
                assert torch.equal(p, q), f"{label} resumed step {step}: {pname} differs by " \
                    f"{(p - q).abs().max().item():.3g}"
        exchange.close()
        done.append(label)
    return done


def test_momentum_correction_equals_gradient_exchange_bit_for_bit_and_resumes() -> None:
    labels = ["topk:0.3", "topk:0.3 nesterov", "+".join(SENT_AS), "+".join(SENT_AS) + " nesterov"]
    assert run_warm(_momentum_worker, 2, timeout=180) == [labels] * 2


def _adopt_worker(rank: int, world_size: int) -> int:
    """Re-planning in both drivers: after three steps both take the same new plan (the same groups, each sent
    another way), the engine starting every codec afresh and keeping the momentum velocities, and they continue
    alike. Bit for bit, before and after."""
    model = ladder()
    before = mixed_plan(model, SENT_AS)
    after = mixed_plan(model, SENT_AS[1:] + SENT_AS[:1])
    assert [g.params for g in after.groups] == [g.params for g in before.groups]
    assert [str(after.compressor_of(g)) for g in after.groups] != [str(before.compressor_of(g)) for g in before.groups]
    twin = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, twin)]
    hook = PlanHook(model, before, momentum=0.9, optimizer=opts[0])
    ddp = DistributedDataParallel(model, **hook.ddp_kwargs())
    hook.register(ddp)
    x, y = _ladder_batch(rank, 99)
    nn.functional.mse_loss(ddp(x), y).backward()  # the warm-up iteration, no step
    exchange = GradientExchange(twin, before, momentum=0.9, optimizer=opts[1])
    compared = 0
    for step in range(6):
        if step == 3:
            hook._adopt(after, flush=False)
            exchange._adopt(after, flush=False)
            assert hook.plan is after and exchange.plan is after
        _step_both(rank, step, ddp, twin, exchange, opts)
        compared += 1
    exchange.close()
    hook.remove_hooks()
    return compared


def test_both_drivers_take_a_new_plan_alike() -> None:
    assert run_warm(_adopt_worker, 2) == [6, 6]
