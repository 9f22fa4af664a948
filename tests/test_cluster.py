"""What-if clusters: specs and presets, the collective model, profiles for a cluster, parsing, scaling tables."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.contracts.profile import Profile
from planner.costmodel.costs import AffineCost, CostModel
from planner.costmodel.curves import affine, curve_model, select_model, worst_error
from planner.costmodel.from_profile import gradient_problem
from planner.costmodel.measured import MAX_FIT_ERROR
from planner.costmodel.simulator import simulate
from planner.strategies.cluster import (
    CURVE_SIZES,
    PRESETS,
    ClusterSpec,
    ScalingRow,
    algorithm_cost,
    collective_seconds,
    collective_seconds_many,
    parse_cluster,
    parse_world_sizes,
    profile_for_cluster,
    scaling_table,
    spec_from_profile,
)
from planner.strategies.gradients import make_plan
from planner.strategies.kfac_plan import make_kfac_plan
from planner.types import Collective, PlannerError, PlannerFileError, SchemaError, Strategy
from tests.factories import examples, synthetic_profile

TOL = 1e-12

#: A small cluster with round numbers: a_i = 2e-6 s, b_i = 1e-10 s/B, a_e = 1e-5 s, b_e = 1e-9 s/B.
SMALL = ClusterSpec(nodes=2, gpus_per_node=4, intra_gbps=80.0, intra_latency_us=2.0, inter_gbps=8.0,
                    inter_latency_us=10.0)


@pytest.fixture(scope="module")
def profile() -> Profile:
    return synthetic_profile("mlp", world_size=2)


def _raises_one_line(exc: type[Exception], match: str, fn: Callable[[], object]) -> str:
    """`fn()` raises `exc` (a PlannerError) matching `match`, with a message of one line; returns the message."""
    with pytest.raises(exc, match=match) as info:
        fn()
    message = str(info.value)
    assert isinstance(info.value, PlannerError)
    assert "\n" not in message and message.strip() == message
    return message


# -- specs and presets ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate_and_round_trip(name: str) -> None:
    spec = PRESETS[name]
    assert spec.name == name and spec.source and "(what-if " in spec.device
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    assert ClusterSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert parse_cluster(name) == spec
    assert "\n" not in spec.describe() and name in spec.describe()
    info = spec.cluster_info()
    assert (info.world_size, info.host_count, info.backend) == (spec.world_size, spec.nodes, "nccl")


def test_preset_shapes_and_links() -> None:
    shapes = {name: (s.nodes, s.gpus_per_node) for name, s in PRESETS.items()}
    assert shapes == {"eth10-8": (2, 4), "aws-p3-32": (4, 8), "ib100-64": (8, 8), "dgx-a100-512": (64, 8)}
    assert PRESETS["eth10-8"].intra_gbps == pytest.approx(15.75 * 8)
    assert PRESETS["eth10-8"].inter_gbps == 10.0
    assert PRESETS["aws-p3-32"].inter_gbps == 25.0
    assert PRESETS["ib100-64"].inter_gbps == 100.0
    assert PRESETS["dgx-a100-512"].inter_gbps == 1600.0
    assert "https://aws.amazon.com/ec2/instance-types/p3/" in PRESETS["aws-p3-32"].source


def test_from_dict_refuses_unknown_and_missing_fields() -> None:
    data = SMALL.to_dict()
    unknown = {**data, "speed": 1}
    _raises_one_line(SchemaError, r"unknown field\(s\) \['speed'\]", lambda: ClusterSpec.from_dict(unknown))
    del data["inter_gbps"]
    _raises_one_line(SchemaError, r"missing field\(s\) \['inter_gbps'\]", lambda: ClusterSpec.from_dict(data))
    minimal = {k: SMALL.to_dict()[k] for k in ("nodes", "gpus_per_node", "intra_gbps", "intra_latency_us",
                                               "inter_gbps", "inter_latency_us")}
    assert ClusterSpec.from_dict(minimal) == SMALL


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"inter_gbps": -1.0}, r"`inter_gbps > 0` must hold, but got \(inter_gbps=-1.0\)"),
        ({"intra_gbps": 0}, r"`intra_gbps > 0` must hold"),
        ({"inter_gbps": math.inf}, r"`inter_gbps` must be a finite number"),
        ({"intra_latency_us": math.nan}, r"`intra_latency_us` must be a finite number"),
        ({"inter_latency_us": -1.0}, r"`inter_latency_us >= 0` must hold"),
        ({"gpus_per_node": 0}, r"`gpus_per_node >= 1` must hold, but got \(gpus_per_node=0\)"),
        ({"nodes": 0}, r"`nodes >= 1` must hold"),
        ({"nodes": 2.0}, r"`nodes` must be an integer"),
        ({"nodes": True}, r"`nodes` must be an integer"),
        ({"compute_factor": 0.0}, r"`compute_factor > 0` must hold"),
        ({"algorithm": "butterfly"}, r"`algorithm in \('ring', 'tree', 'auto'\)` must hold"),
        ({"comm_profile": ""}, r"`comm_profile` must be a profile path or None"),
        ({"name": ""}, r"`name` must not be empty"),
    ],
)
def test_bad_specs_are_refused_in_one_line(change: dict[str, Any], match: str) -> None:
    _raises_one_line(SchemaError, match, lambda: replace(SMALL, **change))


def test_with_world_size_keeps_links_and_node_shape() -> None:
    ib = PRESETS["ib100-64"]
    big = ib.with_world_size(1024)
    assert (big.nodes, big.gpus_per_node, big.world_size) == (128, 8, 1024)
    assert replace(big, nodes=ib.nodes) == ib
    small = ib.with_world_size(4)
    assert (small.nodes, small.gpus_per_node) == (1, 4)
    msg = _raises_one_line(SchemaError, r"world size 12 is not a multiple of gpus_per_node=8",
                           lambda: ib.with_world_size(12))
    assert "8 or 16" in msg
    _raises_one_line(SchemaError, r"`world_size >= 1` must hold", lambda: ib.with_world_size(0))


# -- the collective model ---------------------------------------------------------------------------------------


def test_allreduce_matches_hand_computed_costs() -> None:
    n = 1e6
    # intra ring: 2*3*2e-6 + 2*3/4*n*1e-10 = 1.62e-4; across 2 nodes, ring: 2*1e-5 + n*1e-9, tree: 2*1e-5 + 2n*1e-9
    ring, tree = 1.62e-4 + 2e-5 + 1e-3, 1.62e-4 + 2e-5 + 2e-3
    assert collective_seconds(replace(SMALL, algorithm="ring"), Collective.ALLREDUCE, n) == pytest.approx(ring)
    assert collective_seconds(replace(SMALL, algorithm="tree"), Collective.ALLREDUCE, n) == pytest.approx(tree)
    assert collective_seconds(SMALL, Collective.ALLREDUCE, n) == pytest.approx(min(ring, tree))
    # 4 nodes of 2 GPUs, 1000 bytes: the tree's 2*log2(4) start-ups beat the ring's 2*3
    four = replace(SMALL, nodes=4, gpus_per_node=2)
    ring4 = 2 * 2e-6 + 1000 * 1e-10 + 6 * 1e-5 + 1.5 * 1000 * 1e-9
    tree4 = 2 * 2e-6 + 1000 * 1e-10 + 4 * 1e-5 + 2 * 1000 * 1e-9
    assert collective_seconds(replace(four, algorithm="ring"), Collective.ALLREDUCE, 1000) == pytest.approx(ring4)
    assert collective_seconds(four, Collective.ALLREDUCE, 1000) == pytest.approx(tree4)


def test_allgather_and_broadcast_match_hand_computed_costs() -> None:
    ring, tree = replace(SMALL, algorithm="ring"), replace(SMALL, algorithm="tree")
    # allgather of m = 1000 bytes per rank: gather in the node, one block of 4m across, spread the remote block
    gather = 3 * (2e-6 + 1000 * 1e-10) + (1e-5 + 4 * 1000 * 1e-9) + 3 * (2e-6 + 1000 * 1e-10)
    assert collective_seconds(ring, Collective.ALLGATHER, 1000) == pytest.approx(gather)
    assert collective_seconds(tree, Collective.ALLGATHER, 1000) == pytest.approx(gather)  # log2(2) = 2 - 1
    # broadcast of 1e6 bytes: ring (N-1) a_e + n b_e + (G-1) a_i + n b_i, tree with log2 hops
    assert collective_seconds(ring, Collective.BROADCAST, 1e6) == pytest.approx(1e-5 + 1e-3 + 3 * 2e-6 + 1e-4)
    assert collective_seconds(tree, Collective.BROADCAST, 1e6) == pytest.approx(1e-5 + 1e-3 + 2 * 2e-6 + 1e-4)


@pytest.mark.parametrize("collective", list(Collective))
@pytest.mark.parametrize("algorithm", ["ring", "tree", "auto"])
def test_one_gpu_and_no_bytes_cost_nothing(collective: Collective, algorithm: str) -> None:
    one = replace(SMALL, nodes=1, gpus_per_node=1, algorithm=algorithm)
    assert collective_seconds(one, collective, 1 << 20) == 0.0
    assert collective_seconds(SMALL, collective, 0) == 0.0
    assert set(curve_model(one.curves()[collective]).cost_many(np.asarray([1.0, 1e9]))) == {0.0}


def test_ring_allreduce_grows_with_world_size_when_start_up_dominates() -> None:
    ring = replace(PRESETS["ib100-64"], algorithm="ring")
    costs = [collective_seconds(ring.with_world_size(w), Collective.ALLREDUCE, 1024) for w in parse_world_sizes(
        "2,4,...,1024")]
    assert all(b > a for a, b in itertools.pairwise(costs))


def test_vectorised_matches_scalar() -> None:
    sizes = np.asarray([0, 1, 1000, 1 << 20, 3 << 28], dtype=float)
    for collective in Collective:
        many = collective_seconds_many(PRESETS["aws-p3-32"], collective, sizes)
        assert list(many) == [collective_seconds(PRESETS["aws-p3-32"], collective, float(x)) for x in sizes]


@settings(deadline=None, max_examples=examples(150))
@given(
    nodes=st.integers(1, 300),
    gpus=st.integers(1, 16),
    algorithm=st.sampled_from(["ring", "tree", "auto"]),
    collective=st.sampled_from(list(Collective)),
    n=st.floats(0, 1e10),
    more=st.floats(0, 1e10),
    gbps=st.tuples(st.floats(0.1, 5000), st.floats(0.1, 5000)),
    lat=st.tuples(st.floats(0, 100), st.floats(0, 100)),
)
def test_costs_never_decrease_with_bytes_nodes_or_gpus(
    nodes: int, gpus: int, algorithm: str, collective: Collective, n: float, more: float,
    gbps: tuple[float, float], lat: tuple[float, float],
) -> None:
    spec = ClusterSpec(nodes=nodes, gpus_per_node=gpus, intra_gbps=gbps[0], intra_latency_us=lat[0],
                       inter_gbps=gbps[1], inter_latency_us=lat[1], algorithm=algorithm)
    base = collective_seconds(spec, collective, n)
    slack = 1e-12 * base
    assert base >= 0
    assert collective_seconds(spec, collective, n + more) >= base - slack
    assert collective_seconds(replace(spec, nodes=nodes + 1), collective, n) >= base - slack
    assert collective_seconds(replace(spec, gpus_per_node=gpus + 1), collective, n) >= base - slack


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_ring_and_tree_curves_are_exact(profile: Profile, name: str, algorithm: str) -> None:
    spec = replace(PRESETS[name], algorithm=algorithm)
    what_if = profile_for_cluster(profile, spec)
    for collective in Collective:
        model = curve_model(what_if.curve(collective))
        assert isinstance(model, AffineCost)
        exact = algorithm_cost(spec, collective, algorithm)
        assert model.alpha == pytest.approx(exact.alpha, rel=1e-9)
        assert model.beta == pytest.approx(exact.beta, rel=1e-9)
        for size in (*CURVE_SIZES, 3000, 5 << 30):
            assert model.cost(size) == pytest.approx(collective_seconds(spec, collective, size), rel=1e-9)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("world_size", [8, 16, 64, 512])
def test_auto_curve_holds_the_model_points_and_follows_the_model_between_them(
    profile: Profile, name: str, world_size: int
) -> None:
    spec = PRESETS[name].with_world_size(world_size)
    for collective, curve in profile_for_cluster(profile, spec).collectives.items():
        for size, seconds in curve.points:
            assert seconds == collective_seconds(spec, collective, size)
        # Fitted like a measured curve: the affine fit where it holds at every point (it may be off by up to
        # MAX_FIT_ERROR near the size where ring and tree cross), else interpolation of the points, which is
        # exact: the sizes where ring and tree cross are among them, so each piece lies on one algorithm's line.
        sizes = np.geomspace(CURVE_SIZES[0], CURVE_SIZES[-1], 400)
        rel = curve_model(curve).cost_many(sizes) / collective_seconds_many(spec, collective, sizes) - 1
        if isinstance(curve_model(curve), AffineCost):
            assert np.max(np.abs(rel)) <= max(worst_error(curve), 1e-9) + 1e-9 <= MAX_FIT_ERROR + 1e-9
        else:
            assert worst_error(curve) > MAX_FIT_ERROR
            assert np.max(np.abs(rel)) <= 1e-9


class _Model(CostModel):
    """The cluster model itself as a cost model (what the solvers should see)."""

    def __init__(self, spec: ClusterSpec, collective: Collective) -> None:
        self.spec, self.collective = spec, collective

    def cost(self, x: float) -> float:
        return collective_seconds(self.spec, self.collective, x)


@pytest.mark.parametrize("strategy", [Strategy.DENSE, Strategy.TOPK])
def test_plans_predict_with_the_scaled_collective_model(profile: Profile, strategy: Strategy) -> None:
    spec = replace(PRESETS["eth10-8"], algorithm="ring")
    collective = Collective.ALLREDUCE if strategy is Strategy.DENSE else Collective.ALLGATHER
    density = 0.01 if strategy is Strategy.TOPK else None
    predicted = []
    for world in (8, 64):
        shaped = spec.with_world_size(world)
        what_if = profile_for_cluster(profile, shaped)
        plan = make_plan(what_if, strategy, density)
        assert plan.cluster == shaped.cluster_info()
        problem = replace(gradient_problem(what_if, strategy, density), comm=_Model(shaped, collective))
        assert problem.world_size == world
        ends = tuple(np.cumsum([len(g.layers) for g in plan.groups]))
        reference = simulate(problem, ends)
        assert plan.predicted.comm_s == pytest.approx(reference.comm_s, rel=1e-9)
        assert plan.predicted.iteration_s == pytest.approx(reference.iteration_s, rel=1e-9)
        predicted.append(plan.predicted)
    assert predicted[1].comm_s > predicted[0].comm_s


# -- profiles for a cluster -------------------------------------------------------------------------------------


def test_compute_factor_scales_compute_and_leaves_comm(profile: Profile) -> None:
    base = profile_for_cluster(profile, PRESETS["ib100-64"])
    fast = profile_for_cluster(profile, replace(PRESETS["ib100-64"], compute_factor=0.05))
    assert fast.collectives == base.collectives and fast.cluster == base.cluster
    assert base.forward_s == profile.forward_s and base.layers == profile.layers and base.kfac == profile.kfac
    for attr in ("forward_s", "backward_s", "update_s"):
        assert getattr(fast, attr) == pytest.approx(0.05 * getattr(profile, attr), rel=TOL)
    for a, b in zip(fast.layers, profile.layers, strict=True):
        assert (a.name, a.numel, a.params) == (b.name, b.numel, b.params)
        for attr in ("forward_s", "backward_s", "backward_iqr_s"):
            assert getattr(a, attr) == pytest.approx(0.05 * getattr(b, attr), rel=TOL)
    assert fast.topk is not None and profile.topk is not None
    assert [(n, d) for n, d, _ in fast.topk.select] == [(n, d) for n, d, _ in profile.topk.select]
    assert [t for *_, t in fast.topk.select] == pytest.approx([0.05 * t for *_, t in profile.topk.select])
    assert curve_model(fast.topk.decode).cost(1e5) == pytest.approx(0.05 * curve_model(profile.topk.decode).cost(1e5))
    assert select_model(fast.topk, 0.01).cost(1e5) == pytest.approx(0.05 * select_model(profile.topk, 0.01).cost(1e5))
    assert fast.kfac is not None and profile.kfac is not None
    for ka, kb in zip(fast.kfac.layers, profile.kfac.layers, strict=True):
        for attr in ("a_compute_s", "g_compute_s", "fold_s", "precondition_eigen_s", "precondition_inverse_s",
                     "a_compute_whole_s", "g_compute_whole_s", "fold_whole_s"):
            assert getattr(ka, attr) == pytest.approx(0.05 * getattr(kb, attr), rel=TOL)
    for curve in ("eigen", "inverse"):
        fc, pc = getattr(fast.kfac, curve), getattr(profile.kfac, curve)
        assert [d for d, _ in fc.points] == [d for d, _ in pc.points]
        assert curve_model(fc).cost(300) == pytest.approx(0.05 * curve_model(pc).cost(300), rel=1e-9)
        assert fc.fit_error == pc.fit_error


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_what_if_profiles_are_valid_and_round_trip(profile: Profile, name: str, tmp_path: Path) -> None:
    what_if = profile_for_cluster(profile, replace(PRESETS[name], compute_factor=0.3))
    assert Profile.from_dict(what_if.to_dict()) == what_if
    what_if.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == what_if
    assert what_if.cluster.world_size == PRESETS[name].world_size
    assert what_if.cluster.host_count == PRESETS[name].nodes


@pytest.mark.parametrize(("world", "hosts"), [(2, 1), (8, 1), (8, 2), (6, 6), (16, 4)])
def test_spec_from_profile_reproduces_the_measured_allreduce(profile: Profile, world: int, hosts: int) -> None:
    measured = replace(profile, cluster=replace(profile.cluster, world_size=world, host_count=hosts))
    spec = spec_from_profile(measured)
    assert (spec.world_size, spec.nodes, spec.algorithm, spec.comm_profile) == (world, hosts, "ring", None)
    assert (spec.device, spec.backend) == (measured.cluster.device, measured.cluster.backend)
    fit = measured.curve(Collective.ALLREDUCE)
    model = profile_for_cluster(measured, spec).curve(Collective.ALLREDUCE)
    assert model.alpha_s == pytest.approx(fit.alpha_s, rel=1e-6)
    assert model.beta_s_per_byte == pytest.approx(fit.beta_s_per_byte, rel=1e-6)
    bigger = collective_seconds(spec.with_world_size(world * 8), Collective.ALLREDUCE, 1 << 20)
    assert bigger > affine(fit).cost(1 << 20)


def test_spec_from_profile_refuses_what_it_cannot_invert(profile: Profile) -> None:
    one = replace(profile, cluster=replace(profile.cluster, world_size=1))
    _raises_one_line(SchemaError, "measured on one worker", lambda: spec_from_profile(one))
    odd = replace(profile, cluster=replace(profile.cluster, world_size=6, host_count=4))
    _raises_one_line(SchemaError, "not a multiple of its host count 4", lambda: spec_from_profile(odd))
    flat = replace(profile.collectives[Collective.ALLREDUCE], beta_s_per_byte=0.0)
    no_beta = replace(profile, collectives={**profile.collectives, Collective.ALLREDUCE: flat})
    _raises_one_line(SchemaError, "no per-byte cost", lambda: spec_from_profile(no_beta))


def test_comm_profile_is_used_at_its_own_world_size(profile: Profile, tmp_path: Path) -> None:
    path = tmp_path / "measured.json"
    profile.save(path)
    spec = spec_from_profile(profile, str(path))
    assert spec.comm_profile == str(path)
    same = profile_for_cluster(profile, spec)
    assert same.collectives == profile.collectives  # measured points and fits, as they are
    assert same.cluster == spec.cluster_info()
    bigger = spec.with_world_size(16)
    assert profile_for_cluster(profile, bigger).collectives == bigger.curves()
    parsed = parse_cluster(f"profile={path},world_size=16,compute_factor=0.5")
    assert parsed == replace(bigger, compute_factor=0.5)
    assert parse_cluster(f"profile={path}") == spec


# -- parsing ----------------------------------------------------------------------------------------------------


def test_parse_cluster_forms(tmp_path: Path) -> None:
    inline = ("nodes=2,gpus_per_node=4,intra_gbps=80,intra_latency_us=2,inter_gbps=8,inter_latency_us=10")
    assert parse_cluster(inline) == SMALL
    assert parse_cluster(f" {inline} , algorithm = ring ") == replace(SMALL, algorithm="ring")
    over = parse_cluster("ib100-64,compute_factor=0.05,nodes=2")
    assert over == replace(PRESETS["ib100-64"], compute_factor=0.05, nodes=2)
    assert parse_cluster("dgx-a100-512,world_size=1024").nodes == 128
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(SMALL.to_dict()))
    assert parse_cluster(str(path)) == SMALL
    assert parse_cluster(f"{path},nodes=4") == replace(SMALL, nodes=4)


@pytest.mark.parametrize(
    ("text", "error", "match"),
    [
        ("ib100", SchemaError, r"unknown cluster preset 'ib100'; known presets: eth10-8, aws-p3-32, ib100-64"),
        ("ib100-64,speed=3", SchemaError, r"unknown key 'speed'; known keys: .*inter_gbps"),
        ("ib100-64,inter_gbps=fast", SchemaError, r"`inter_gbps` must be a number, but got 'fast'"),
        ("ib100-64,nodes=2.5", SchemaError, r"`nodes` must be an integer, but got '2.5'"),
        ("ib100-64,inter_gbps=-1", SchemaError, r"`inter_gbps > 0` must hold, but got \(inter_gbps=-1.0\)"),
        ("ib100-64,inter_gbps=nan", SchemaError, r"`inter_gbps` must be a finite number"),
        ("ib100-64,gpus_per_node=0", SchemaError, r"`gpus_per_node >= 1` must hold"),
        ("ib100-64,world_size=12", SchemaError, r"world size 12 is not a multiple of gpus_per_node=8"),
        ("ib100-64,nodes", SchemaError, r"expected key=value, but got 'nodes'"),
        ("ib100-64,nodes=2,nodes=3", SchemaError, r"key 'nodes' is given twice"),
        ("nodes=2,gpus_per_node=4", SchemaError, r"missing key\(s\) intra_gbps, intra_latency_us, inter_gbps"),
        ("", SchemaError, r"empty cluster"),
        ("missing/cluster.json", PlannerFileError, r"cluster file not found: missing/cluster.json"),
        ("profile=missing.json", PlannerFileError, r"profile file not found: missing.json"),
    ],
)
def test_parse_cluster_errors_are_one_line(text: str, error: type[Exception], match: str) -> None:
    _raises_one_line(error, match, lambda: parse_cluster(text))


def test_parse_cluster_refuses_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({**SMALL.to_dict(), "inter_gbps": -2, "colour": "red"}))
    _raises_one_line(SchemaError, r"unknown field\(s\) \['colour'\] in cluster file", lambda: parse_cluster(str(path)))
    path.write_text(json.dumps({**SMALL.to_dict(), "inter_gbps": -2}))
    _raises_one_line(SchemaError, r"cluster file .*: `inter_gbps > 0` must hold", lambda: parse_cluster(str(path)))
    path.write_text("{ not json")
    _raises_one_line(SchemaError, r"is not valid JSON", lambda: parse_cluster(str(path)))


@pytest.mark.parametrize(
    ("text", "sizes"),
    [
        ("8,64,512", [8, 64, 512]),
        ("4,8,...,1024", [4, 8, 16, 32, 64, 128, 256, 512, 1024]),
        ("1, 2, 4, ..., 16", [1, 2, 4, 8, 16]),
        ("8,64,...,512", [8, 64, 512]),
        ("3,9,...,9", [3, 9]),
        ("16", [16]),
    ],
)
def test_parse_world_sizes(text: str, sizes: list[int]) -> None:
    assert parse_world_sizes(text) == sizes


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", r"no world sizes given"),
        ("4,6,...,16", r"`SECOND / FIRST` must be an integer >= 2, but got 6/4"),
        ("4,4,...,16", r"must be an integer >= 2"),
        ("4,8,...,1000", r"the last term 1000 is not reached exactly: ratio 2 goes from 512 to 1024"),
        ("8,0,16", r"`1 <= world_size <= 1048576` must hold, but got 0"),
        ("4,8,...,3", r"the last term 3 is below 8; write them increasing"),
        ("8," + "9" * 400, r"but got a 400-digit number"),
        ("8,2097152", r"`1 <= world_size <= 1048576` must hold, but got 2097152"),
        ("8,x", r"'x' is not an integer"),
        ("4,...,16", r"write the ellipsis as FIRST,SECOND,...,LAST"),
        ("4,8,...", r"write the ellipsis as FIRST,SECOND,...,LAST"),
        ("2,4,7,...,28", r"\[2, 4, 7\] is not geometric with ratio 2"),
        ("8,,16", r"'' is not an integer"),
    ],
)
def test_parse_world_sizes_errors_are_one_line(text: str, match: str) -> None:
    _raises_one_line(SchemaError, match, lambda: parse_world_sizes(text))


# -- scaling ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["dense", "topk", "kfac"])
def test_scaling_table_rows_are_bounded_by_baselines_and_lower_bound(profile: Profile, strategy: str) -> None:
    worlds = [1, 4, 8, 64, 1024]
    seen: list[ScalingRow] = []
    rows = scaling_table(profile, replace(PRESETS["ib100-64"], compute_factor=0.1), worlds, strategy=strategy,
                         on_row=seen.append)
    assert seen == rows
    assert [(r.world_size, r.nodes, r.gpus_per_node) for r in rows] == [
        (1, 1, 1), (4, 1, 4), (8, 1, 8), (64, 8, 8), (1024, 128, 8)
    ]
    for row in rows:
        assert row.plan_s >= row.lower_bound_s - TOL
        assert all(type(v) is float for v in row.baselines.values())
        if strategy == "kfac":
            for name in ("kfac-pytorch", "everywhere"):
                assert row.plan_s <= row.baselines[name] + TOL
        else:
            assert row.baselines and all(row.plan_s <= v + TOL for v in row.baselines.values())
    assert rows[0].plan_s <= rows[-1].plan_s or strategy == "kfac"  # K-FAC: more workers share inversions


def test_scaling_table_matches_the_plans_it_summarises(profile: Profile) -> None:
    spec = PRESETS["aws-p3-32"]
    (row,) = scaling_table(profile, spec, [32], strategy="topk", density=0.05)
    plan = make_plan(profile_for_cluster(profile, spec), Strategy.TOPK, 0.05)
    assert row.plan_s == plan.predicted.iteration_s and row.lower_bound_s == plan.lower_bound_s
    assert row.baselines == {name: p.iteration_s for name, p in plan.baselines.items()}
    (row,) = scaling_table(profile, spec, [32], strategy="kfac", inv_update_steps=5)
    section = make_kfac_plan(profile_for_cluster(profile, spec), inv_update_steps=5).kfac
    assert section is not None and section.predicted is not None
    assert row.plan_s == section.predicted.step_s and row.lower_bound_s == section.lower_bound_s
    _raises_one_line(SchemaError, r"`strategy in \('dense', 'topk', 'kfac'\)` must hold",
                     lambda: scaling_table(profile, spec, [8], strategy="sparse"))


def test_scaling_table_refuses_a_world_size_that_is_not_whole_nodes(profile: Profile) -> None:
    with pytest.raises(SchemaError, match="world size 12 is not a multiple of gpus_per_node=8"):
        scaling_table(profile, PRESETS["ib100-64"], [8, 12])


def test_a_one_gpu_what_if_profile_round_trips_and_costs_nothing(tmp_path: Path) -> None:
    one = profile_for_cluster(synthetic_profile("mlp"), PRESETS["ib100-64"].with_world_size(1))
    path = tmp_path / "one.json"
    one.save(path)
    loaded = Profile.load(path)
    assert loaded.cluster.world_size == 1
    assert all(curve_model(loaded.curve(c)).cost(1 << 20) == 0.0 for c in Collective)
