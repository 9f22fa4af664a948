"""What-if clusters: plan for a cluster you describe but do not have.

A `ClusterSpec` describes a cluster by its shape (nodes x GPUs per node), its links and how fast its GPUs
compute relative to the profiled device. `profile_for_cluster` turns a measured profile into the profile the
model predicts for that cluster (collective curves from the link model, compute times scaled), and the
ordinary solvers plan for it; `scaling_table` does so for a list of world sizes.

The collective model
--------------------

Costs follow the alpha-beta model of Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH" (IJHPCA 19(1), 2005): sending n bytes over a link costs alpha + n * beta,
alpha its latency (s) and beta the inverse of its bandwidth (s/byte). Ring allreduce (reduce-scatter then
allgather, bandwidth-optimal: Patarasuk & Yuan, JPDC 2009) costs 2(P-1) alpha + 2(P-1)/P n beta on P ranks;
ring allgather (P-1)(alpha + m beta); recursive doubling log2(P) alpha + (P-1) m beta. Collectives are
hierarchical as in NCCL: the GPUs of a node first combine over the node's links, then the nodes exchange
over the network, then the result spreads inside each node. "tree" is NCCL's pipelined double binary tree
(Sanders, Speck & Träff, "Two-tree algorithms for full bandwidth broadcast, reduction and scan", Parallel
Computing 2009; NCCL 2.4) between nodes; inside a node both algorithms use the ring / chain through the
node's GPUs. "auto" takes the cheaper of the two at each message size, as NCCL's tuner picks per size.

N = nodes, G = GPUs per node; intra links (a_i, b_i) per GPU; inter links (a_e, b_e) per node, shared by
the node's G GPUs (so a node's traffic, not a GPU's, goes through b_e); L(x) = ceil(log2 x). For a message
of n bytes per rank (each line only when its level has more than one member, so one GPU costs nothing):

    allreduce  intra   2(G-1) a_i + 2(G-1)/G n b_i              reduce-scatter + allgather in the node
               ring    2(N-1) a_e + 2(N-1)/N n b_e              the node's n bytes (G shards of n/G) in a ring
               tree    2 L(N) a_e + 2 n b_e                     pipelined reduce up + broadcast down
    allgather  intra   (G-1) (a_i + m b_i)                      each rank gives m bytes, all end with N G m
               ring    (N-1) (a_e + G m b_e)                    node blocks of G m bytes around the nodes
               tree    L(N) a_e + (N-1) G m b_e                 recursive doubling between nodes
               spread  (G-1) (a_i + (N-1) m b_i)                the remote blocks spread inside the node
    broadcast  ring    (N-1) a_e + n b_e + (G-1) a_i + n b_i    pipelined chain across nodes, then in the node
               tree    L(N) a_e + n b_e + L(G) a_i + n b_i      pipelined trees

Every algorithm is affine in the message size, so `ClusterSpec.curves()` (points on a log grid, then the
profile's own fit) reproduces ring and tree exactly. "auto", a minimum of two affine functions, is sampled
at the sizes where they cross too and is then treated like a measured curve: the solvers use its affine fit
when that is within `planner.costmodel.measured.MAX_FIT_ERROR` (5%) at every point, as for a measured NCCL curve,
and otherwise interpolates the samples, so near the crossover the prediction is off by at most that; "ring" or
"tree" give the exact model.
Bandwidths are given in Gbit/s (b = 8 / (gbps * 1e9) s/byte) and latencies in microseconds.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from planner.contracts.fingerprint import ClusterInfo
from planner.contracts.jsonio import MAX_WORLD_SIZE, check_fields, expect, is_file, read_json
from planner.contracts.profile import FittedCurve, KFACTiming, LayerTiming, Profile, TopkTiming
from planner.costmodel.costs import AffineCost
from planner.costmodel.curves import fit_curve
from planner.strategies.gradients import make_plan
from planner.strategies.kfac_plan import DEFAULT_FACTOR_UPDATE_STEPS, DEFAULT_INV_UPDATE_STEPS, make_kfac_plan
from planner.types import Collective, InverseMethod, SchemaError, Strategy

__all__ = [
    "ALGORITHMS",
    "PRESETS",
    "ClusterSpec",
    "ScalingRow",
    "algorithm_cost",
    "collective_seconds",
    "collective_seconds_many",
    "parse_cluster",
    "parse_world_sizes",
    "profile_for_cluster",
    "scaling_table",
    "spec_from_profile",
]

#: Collective algorithms of the model; "auto" is the cheaper of "ring" and "tree" at each size.
ALGORITHMS = ("ring", "tree", "auto")

#: Message sizes (bytes) the curves are sampled at: 1 KiB to 1 GiB, a factor 4 apart.
CURVE_SIZES = tuple(1024 * 4**k for k in range(11))

_LINK_FIELDS = ("nodes", "gpus_per_node", "intra_gbps", "intra_latency_us", "inter_gbps", "inter_latency_us")
_INT_FIELDS = ("nodes", "gpus_per_node")
_FLOAT_FIELDS = ("intra_gbps", "intra_latency_us", "inter_gbps", "inter_latency_us", "compute_factor")
_POSITIVE_FIELDS = ("intra_gbps", "inter_gbps", "compute_factor")
#: What a described cluster may hold: 1 kbit/s to 1 Pbit/s per link, latencies up to an hour, and GPUs
#: from a million times faster to a million times slower than profiled.
_FLOAT_RANGES = {
    "intra_gbps": (1e-6, 1e6), "inter_gbps": (1e-6, 1e6),
    "intra_latency_us": (0.0, 3.6e9), "inter_latency_us": (0.0, 3.6e9),
    "compute_factor": (1e-6, 1e6),
}
_STR_FIELDS = ("name", "algorithm", "device", "backend", "source")


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _ceil_log2(x: int) -> int:
    """ceil(log2 x) for x >= 1."""
    return (x - 1).bit_length()


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """A cluster to plan for: its shape, its links, and its compute speed relative to the profiled device.

    Attributes:
        name: preset name, or "custom".
        nodes: number of nodes N. gpus_per_node: GPUs per node G (world size N * G).
        intra_gbps: per-GPU link bandwidth inside a node (Gbit/s). intra_latency_us: its latency (us).
        inter_gbps: per-node network bandwidth between nodes (Gbit/s), shared by the node's GPUs.
        inter_latency_us: the network's latency (us).
        algorithm: "ring", "tree", or "auto" (the cheaper at each message size).
        compute_factor: measured compute times are multiplied by it (0.05: GPUs 20x faster than profiled).
        device, backend: what the cluster's profile and plans record as device and backend.
        source: where the parameters come from (presets name their datasheets).
        comm_profile: a profile measured on another cluster; at its world size its measured collectives
            replace the link model.
    """

    name: str = "custom"
    nodes: int
    gpus_per_node: int
    intra_gbps: float
    intra_latency_us: float
    inter_gbps: float
    inter_latency_us: float
    algorithm: str = "auto"
    compute_factor: float = 1.0
    device: str = "what-if"
    backend: str = "nccl"
    source: str = ""
    comm_profile: str | None = None

    def __post_init__(self) -> None:
        for key in _STR_FIELDS:
            value = getattr(self, key)
            if not isinstance(value, str):
                raise SchemaError(f"`{key}` must be a string, but got ({key}={value!r})")
        if not self.name:
            raise SchemaError("`name` must not be empty, but got (name='')")
        for key in _INT_FIELDS:
            value = getattr(self, key)
            if not _is_int(value):
                raise SchemaError(f"`{key}` must be an integer, but got ({key}={value!r})")
            if value < 1:
                raise SchemaError(f"`{key} >= 1` must hold, but got ({key}={value!r}); a cluster needs a GPU")
            object.__setattr__(self, key, int(value))
        for key in _FLOAT_FIELDS:
            value = getattr(self, key)
            if not isinstance(value, int | float | np.floating) or isinstance(value, bool):
                raise SchemaError(f"`{key}` must be a number, but got ({key}={value!r})")
            value = float(value)
            if not math.isfinite(value):
                raise SchemaError(f"`{key}` must be a finite number, but got ({key}={value!r})")
            if key in _POSITIVE_FIELDS and value <= 0:
                unit = "; bandwidths are in Gbit/s" if key.endswith("gbps") else ""
                raise SchemaError(f"`{key} > 0` must hold, but got ({key}={value!r}){unit}")
            if key not in _POSITIVE_FIELDS and value < 0:
                raise SchemaError(f"`{key} >= 0` must hold, but got ({key}={value!r}); latencies are in microseconds")
            low, high = _FLOAT_RANGES[key]
            if not low <= value <= high:
                raise SchemaError(f"`{low:g} <= {key} <= {high:g}` must hold, but got ({key}={value:g})")
            object.__setattr__(self, key, value)
        if self.nodes * self.gpus_per_node > MAX_WORLD_SIZE:
            raise SchemaError(f"`nodes * gpus_per_node <= {MAX_WORLD_SIZE}` must hold, but got "
                              f"(nodes={self.nodes:,}, gpus_per_node={self.gpus_per_node:,})")
        if self.algorithm not in ALGORITHMS:
            raise SchemaError(f"`algorithm in {ALGORITHMS}` must hold, but got (algorithm={self.algorithm!r})")
        if self.comm_profile is not None and (not isinstance(self.comm_profile, str) or not self.comm_profile):
            raise SchemaError(
                f"`comm_profile` must be a profile path or None, but got (comm_profile={self.comm_profile!r})"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_world_size(self, world_size: int) -> ClusterSpec:
        """The same links at `world_size`: whole nodes of `gpus_per_node` GPUs, or one node when fewer GPUs."""
        if not _is_int(world_size) or world_size < 1:
            raise SchemaError(f"`world_size >= 1` must hold, but got (world_size={world_size!r})")
        g = self.gpus_per_node
        if world_size < g:
            return replace(self, nodes=1, gpus_per_node=int(world_size))
        if world_size % g:
            raise SchemaError(
                f"world size {world_size} is not a multiple of gpus_per_node={g} of cluster {self.name!r}: "
                f"choose a multiple of {g} (e.g. {world_size // g * g} or {(world_size // g + 1) * g}), "
                f"or set gpus_per_node"
            )
        return replace(self, nodes=int(world_size) // g)

    def cluster_info(self) -> ClusterInfo:
        """The cluster fingerprint profiles and plans made for this cluster record."""
        return ClusterInfo(world_size=self.world_size, backend=self.backend, device=self.device,
                           host_count=self.nodes)

    def curves(self) -> dict[Collective, FittedCurve]:
        """Every collective's cost, sampled from the model at `CURVE_SIZES` and fitted as a profile would be."""
        return {c: _model_curve(self, c) for c in Collective}

    def describe(self) -> str:
        """One line: shape, links, algorithm, compute factor."""
        text = (
            f"{self.name}: {self.nodes} x {self.gpus_per_node} GPUs (world size {self.world_size}), "
            f"intra {self.intra_gbps:g} Gb/s + {self.intra_latency_us:g} us, "
            f"inter {self.inter_gbps:g} Gb/s per node + {self.inter_latency_us:g} us, {self.algorithm}, "
            f"compute x{self.compute_factor:g}, {self.device}"
        )
        if self.comm_profile:
            text += f", collectives measured in {self.comm_profile} at its world size"
        return text

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "cluster") -> ClusterSpec:
        """Read and validate a dict of `to_dict`; the link fields are required, the others optional."""
        expect(data, dict, where)
        optional = [f.name for f in fields(cls) if f.name not in _LINK_FIELDS]
        check_fields(data, where, _LINK_FIELDS, optional)
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key in _INT_FIELDS:
                values[key] = expect(value, int, f"{where}.{key}")
            elif key in _FLOAT_FIELDS:
                values[key] = expect(value, (int, float), f"{where}.{key}")
            elif key == "comm_profile":
                values[key] = None if value is None else expect(value, str, f"{where}.{key}")
            else:
                values[key] = expect(value, str, f"{where}.{key}")
        try:
            return cls(**values)
        except SchemaError as exc:
            raise SchemaError(f"{where}: {exc}") from None


# -- the collective model --------------------------------------------------------------------------------------


def _alpha_beta(spec: ClusterSpec) -> tuple[float, float, float, float]:
    """(a_i, b_i, a_e, b_e): latencies in seconds and inverse bandwidths in seconds per byte."""
    return (spec.intra_latency_us * 1e-6, 8.0 / (spec.intra_gbps * 1e9),
            spec.inter_latency_us * 1e-6, 8.0 / (spec.inter_gbps * 1e9))


def algorithm_cost(spec: ClusterSpec, collective: Collective, algorithm: str) -> AffineCost:
    """The affine cost alpha + beta * bytes of `collective` with `algorithm` ("ring" or "tree") on `spec`."""
    if algorithm not in ("ring", "tree"):
        raise SchemaError(f"`algorithm in ('ring', 'tree')` must hold, but got (algorithm={algorithm!r})")
    a_i, b_i, a_e, b_e = _alpha_beta(spec)
    n, g = spec.nodes, spec.gpus_per_node
    ring = algorithm == "ring"
    alpha = beta = 0.0
    match collective:
        case Collective.ALLREDUCE:
            if g > 1:
                alpha += 2 * (g - 1) * a_i
                beta += 2 * (g - 1) / g * b_i
            if n > 1:
                alpha += (2 * (n - 1) if ring else 2 * _ceil_log2(n)) * a_e
                beta += (2 * (n - 1) / n if ring else 2.0) * b_e
        case Collective.ALLGATHER:
            if g > 1:
                alpha += (g - 1) * a_i
                beta += (g - 1) * b_i
            if n > 1:
                alpha += ((n - 1) if ring else _ceil_log2(n)) * a_e
                beta += (n - 1) * g * b_e
                if g > 1:
                    alpha += (g - 1) * a_i
                    beta += (g - 1) * (n - 1) * b_i
        case Collective.BROADCAST:
            if n > 1:
                alpha += ((n - 1) if ring else _ceil_log2(n)) * a_e
                beta += b_e
            if g > 1:
                alpha += ((g - 1) if ring else _ceil_log2(g)) * a_i
                beta += b_i
        case _:
            raise SchemaError(f"the cluster model knows no collective {collective!r}; known: {list(Collective)}")
    return AffineCost(alpha=alpha, beta=beta)


def collective_seconds_many(spec: ClusterSpec, collective: Collective, nbytes: npt.ArrayLike) -> np.ndarray:
    """Vectorised `collective_seconds`: the model's seconds for each message size in `nbytes`."""
    xs = np.asarray(nbytes, dtype=float)
    if spec.algorithm == "auto":
        ring = algorithm_cost(spec, collective, "ring").cost_many(xs)
        tree = algorithm_cost(spec, collective, "tree").cost_many(xs)
        return np.minimum(ring, tree)
    return algorithm_cost(spec, collective, spec.algorithm).cost_many(xs)


def collective_seconds(spec: ClusterSpec, collective: Collective, nbytes: float) -> float:
    """Seconds the model predicts for `collective` of `nbytes` per rank on `spec` (0 for no bytes or one GPU)."""
    return float(collective_seconds_many(spec, collective, np.asarray([nbytes]))[0])


def _model_curve(spec: ClusterSpec, collective: Collective) -> FittedCurve:
    """Model points at `CURVE_SIZES` (plus, for "auto", the sizes where ring and tree cross) and their fit."""
    sizes = set(CURVE_SIZES)
    if spec.algorithm == "auto":
        ring = algorithm_cost(spec, collective, "ring")
        tree = algorithm_cost(spec, collective, "tree")
        if ring.beta != tree.beta:
            cross = (tree.alpha - ring.alpha) / (ring.beta - tree.beta)
            if CURVE_SIZES[0] < cross < CURVE_SIZES[-1]:
                sizes |= {math.floor(cross), math.ceil(cross)}
    xs = sorted(sizes)
    ts = collective_seconds_many(spec, collective, np.asarray(xs))
    points = [(int(x), float(t)) for x, t in zip(xs, ts, strict=True)]
    if not any(t > 0 for _, t in points):  # one GPU communicates nothing
        return FittedCurve(points=tuple(points), alpha_s=0.0, beta_s_per_byte=0.0, fit_error=0.0)
    return fit_curve(points)


# -- presets ---------------------------------------------------------------------------------------------------

_PCIE3_X16_GBPS = 15.75 * 8  # 8 GT/s per lane, 128b/130b encoding: 15.75 GB/s per direction on 16 lanes
_NVLINK2_GBPS = 150.0 * 8  # V100: 300 GB/s total NVLink bandwidth (both directions) = 150 GB/s per direction
_NVLINK3_GBPS = 300.0 * 8  # A100: 600 GB/s total NVLink bandwidth (both directions) = 300 GB/s per direction

PRESETS: dict[str, ClusterSpec] = {
    "eth10-8": ClusterSpec(
        name="eth10-8", nodes=2, gpus_per_node=4,
        intra_gbps=_PCIE3_X16_GBPS, intra_latency_us=5.0, inter_gbps=10.0, inter_latency_us=50.0,
        device="GPU on PCIe 3.0 x16 (what-if eth10-8)", backend="nccl",
        source=(
            "PCIe 3.0 x16 (PCI-SIG PCI Express Base Specification 3.0: 8 GT/s per lane, 128b/130b) = 15.75 GB/s "
            "per direction; 10 Gigabit Ethernet (IEEE 802.3ae) = 10 Gb/s; latencies are typical values "
            "(a few us through NCCL over PCIe, tens of us for TCP over Ethernet)"
        ),
    ),
    "aws-p3-32": ClusterSpec(
        name="aws-p3-32", nodes=4, gpus_per_node=8,
        intra_gbps=_NVLINK2_GBPS, intra_latency_us=3.0, inter_gbps=25.0, inter_latency_us=50.0,
        device="V100 (what-if aws-p3-32)", backend="nccl",
        source=(
            "AWS EC2 P3 instance types (https://aws.amazon.com/ec2/instance-types/p3/): p3.16xlarge has 8 V100 "
            "with NVLink and 25 Gbps networking; NVIDIA V100 datasheet (https://www.nvidia.com/en-us/data-center/"
            "v100/): NVLink 2 300 GB/s total = 150 GB/s per direction; latencies are typical values (a few us "
            "over NVLink through NCCL, tens of us for TCP between instances)"
        ),
    ),
    "ib100-64": ClusterSpec(
        name="ib100-64", nodes=8, gpus_per_node=8,
        intra_gbps=_NVLINK2_GBPS, intra_latency_us=3.0, inter_gbps=100.0, inter_latency_us=1.0,
        device="V100 (what-if ib100-64)", backend="nccl",
        source=(
            "8 DGX-1 (8 V100 with NVLink 2 each); NVIDIA V100 datasheet (https://www.nvidia.com/en-us/"
            "data-center/v100/): NVLink 2 300 GB/s total = 150 GB/s per direction; EDR InfiniBand (InfiniBand "
            "Trade Association roadmap): 100 Gb/s per 4x port, one port per node assumed; latencies are typical "
            "values (~1 us InfiniBand verbs, a few us over NVLink through NCCL)"
        ),
    ),
    "dgx-a100-512": ClusterSpec(
        name="dgx-a100-512", nodes=64, gpus_per_node=8,
        intra_gbps=_NVLINK3_GBPS, intra_latency_us=2.0, inter_gbps=8 * 200.0, inter_latency_us=1.0,
        device="A100 (what-if dgx-a100-512)", backend="nccl",
        source=(
            "64 DGX A100; NVIDIA DGX A100 datasheet (https://www.nvidia.com/en-us/data-center/dgx-a100/): 8 A100 "
            "with NVLink 3 / NVSwitch and 8 single-port 200 Gb/s HDR InfiniBand adapters per node (1600 Gb/s); "
            "NVIDIA A100 datasheet (https://www.nvidia.com/en-us/data-center/a100/): NVLink 3 600 GB/s total = "
            "300 GB/s per direction; latencies are typical values (~1 us InfiniBand verbs, a few us over "
            "NVLink / NVSwitch through NCCL)"
        ),
    ),
}


# -- from a measured profile ------------------------------------------------------------------------------------


def spec_from_profile(profile: Profile, path: str = "") -> ClusterSpec:
    """The links that reproduce `profile`'s measured allreduce fit at its own world size through the ring model.

    With N = host_count nodes of G = world_size / N GPUs, the ring allreduce costs
    (2(G-1) + 2(N-1)) a + (2(G-1)/G + 2(N-1)/N) n b when intra and inter links share (a, b). One curve gives two
    numbers, so intra and inter links cannot be told apart and both get the same latency and bandwidth: with
    one host these are the node's links, used for the network too; with one GPU per host, the network's.

    A profile of several hosts of several workers measured each level (`Profile.hosts`): then the links inside
    a node come from the allreduce inside a host, 2(G-1) a_i + 2(G-1)/G n b_i, and the network's from the
    allreduce across hosts (every local index's shard at once, the node's n bytes), 2(N-1) a_e + 2(N-1)/N n b_e.
    """
    where = f"profile {path}" if path else "the profile"
    world, hosts = profile.cluster.world_size, profile.cluster.host_count
    if world < 2:
        raise SchemaError(
            f"{where} was measured on one worker, so its collectives say nothing about a network: profile on 2 or "
            f"more workers, or describe the cluster (a preset or key=value pairs)"
        )
    if world % hosts:
        raise SchemaError(
            f"{where}: world size {world} is not a multiple of its host count {hosts}, so the GPUs per node are "
            f"unknown: describe the cluster with key=value pairs instead"
        )
    nodes, gpus = hosts, world // hosts
    if profile.hosts is not None and profile.hosts.intra is not None:  # each level measured: a link each
        intra, inter = profile.hosts.intra, profile.hosts.inter
        links = (_ring_link(intra, 2 * (gpus - 1), 2 * (gpus - 1) / gpus, f"{where}: the allreduce inside a host"),
                 _ring_link(inter, 2 * (nodes - 1), 2 * (nodes - 1) / nodes, f"{where}: the allreduce across hosts"))
        source = (f"ring model fitted per level to the allreduce of {where}: inside a host (alpha={intra.alpha_s:.3g} "
                  f"s, beta={intra.beta_s_per_byte:.3g} s/byte) and across hosts (alpha={inter.alpha_s:.3g} s, "
                  f"beta={inter.beta_s_per_byte:.3g} s/byte), {nodes} hosts of {gpus}")
    else:  # one curve: one link for both levels
        fit = profile.curve(Collective.ALLREDUCE)
        link = _ring_link(fit, 2 * (gpus - 1) + 2 * (nodes - 1), 2 * (gpus - 1) / gpus + 2 * (nodes - 1) / nodes,
                          f"{where}: the allreduce fit", "(`planner profile --only comm`)")
        links = (link, link)
        source = (f"ring model fitted to the allreduce of {where} (alpha={fit.alpha_s:.3g} s, "
                  f"beta={fit.beta_s_per_byte:.3g} s/byte, world size {world}, {hosts} host(s))")
    (intra_gbps, intra_us), (inter_gbps, inter_us) = links
    return ClusterSpec(
        name="measured",
        nodes=nodes,
        gpus_per_node=gpus,
        intra_gbps=intra_gbps,
        intra_latency_us=intra_us,
        inter_gbps=inter_gbps,
        inter_latency_us=inter_us,
        algorithm="ring",
        device=profile.cluster.device,
        backend=profile.cluster.backend,
        source=source,
        comm_profile=path or None,
    )


def _ring_link(curve: FittedCurve, latency_terms: float, byte_terms: float, what: str, how: str = "") -> tuple[
        float, float]:
    """(Gbit/s, latency in us) of the link whose ring allreduce costs latency_terms a + byte_terms n b = `curve`."""
    if curve.beta_s_per_byte <= 0:
        raise SchemaError(
            f"{what} has no per-byte cost (beta_s_per_byte={curve.beta_s_per_byte}), so no bandwidth follows from "
            f"it: measure again with larger messages{' ' + how if how else ''}"
        )
    return 8.0 / (curve.beta_s_per_byte / byte_terms * 1e9), curve.alpha_s / latency_terms * 1e6


def _scaled_curve(curve: FittedCurve, factor: float) -> FittedCurve:
    return replace(curve, points=tuple((x, t * factor) for x, t in curve.points), alpha_s=curve.alpha_s * factor,
                   beta_s_per_byte=curve.beta_s_per_byte * factor)


def _scaled_layer(layer: LayerTiming, factor: float) -> LayerTiming:
    return replace(layer, forward_s=layer.forward_s * factor, backward_s=layer.backward_s * factor,
                   backward_iqr_s=layer.backward_iqr_s * factor)


def _scaled_topk(topk: TopkTiming, factor: float) -> TopkTiming:
    return replace(topk.scaled(factor), decode=_scaled_curve(topk.decode, factor),
                   decode_points=tuple((n, d, t * factor) for n, d, t in topk.decode_points))


def _scaled_kfac(kfac: KFACTiming, factor: float) -> KFACTiming:
    def scaled(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * factor

    layers = tuple(
        replace(lt, a_compute_s=lt.a_compute_s * factor, g_compute_s=lt.g_compute_s * factor,
                fold_s=lt.fold_s * factor, precondition_eigen_s=lt.precondition_eigen_s * factor,
                precondition_inverse_s=lt.precondition_inverse_s * factor,
                a_compute_whole_s=scaled(lt.a_compute_whole_s), g_compute_whole_s=scaled(lt.g_compute_whole_s),
                fold_whole_s=scaled(lt.fold_whole_s))
        for lt in kfac.layers
    )
    return replace(kfac, layers=layers, inverse=kfac.inverse.scaled(factor),
                   eigen=kfac.eigen.scaled(factor))


def _collectives_for(spec: ClusterSpec) -> dict[Collective, FittedCurve]:
    """The measured collectives of `spec.comm_profile` at its own world size (the model fills in any it lacks),
    else the model's curves."""
    if spec.comm_profile:
        measured = Profile.load(spec.comm_profile)
        if measured.cluster.world_size == spec.world_size:
            return {**spec.curves(), **measured.collectives}
    return spec.curves()


def profile_for_cluster(profile: Profile, spec: ClusterSpec) -> Profile:
    """`profile` as if measured on `spec`: its collectives, its cluster, and every compute time scaled.

    The interference measured on the profiled machine does not carry over to another cluster: it is dropped
    (no slowdown of compute while communicating is modelled there), and so is fp16's summing beyond an fp32
    allreduce (`CompressTiming.fp16_sum`: the profiled backend's). So are the per-worker speeds
    (`Profile.throughput`) at another world size: the profiled workers' speeds say nothing about the others
    (at the same world size they are kept, scaled)."""
    f = spec.compute_factor
    throughput = profile.throughput
    if throughput is not None:
        throughput = (replace(throughput, step_s=tuple(tuple(t * f for t in row) for row in throughput.step_s))
                      if len(throughput.step_s) == spec.world_size else None)
    return replace(
        profile,
        cluster=spec.cluster_info(),
        collectives=_collectives_for(spec),
        forward_s=profile.forward_s * f,
        backward_s=profile.backward_s * f,
        update_s=profile.update_s * f,
        layers=tuple(_scaled_layer(lt, f) for lt in profile.layers),
        topk=None if profile.topk is None else _scaled_topk(profile.topk, f),
        kfac=None if profile.kfac is None else _scaled_kfac(profile.kfac, f),
        pack=None if profile.pack is None else _scaled_curve(profile.pack, f),
        interference=None,  # measured on the profiled devices and network, unknown on `spec`
        # fp16's summing beyond an fp32 allreduce: the profiled backend's (gloo sums in software), not `spec`'s
        compress=None if profile.compress is None else replace(profile.compress, fp16_sum=None),
        comm_stretch=None,  # the same
        hosts=None,  # the measured hosts' levels are not `spec`'s: the cluster model prices its collectives
        throughput=throughput,
        steps=None,  # the samples of the profiled steps are not `spec`'s (nor scaled): a what-if has no intervals
        slowdown_samples=None,
    )


# -- parsing ---------------------------------------------------------------------------------------------------

_PARSE_KEYS = (*(f.name for f in fields(ClusterSpec)), "world_size", "profile")


def _parse_value(key: str, value: str, text: str) -> Any:
    if key in (*_INT_FIELDS, "world_size"):
        try:
            return int(value)
        except ValueError:
            raise SchemaError(f"cluster {text!r}: `{key}` must be an integer, but got {value!r}") from None
    if key in _FLOAT_FIELDS:
        try:
            return float(value)
        except ValueError:
            raise SchemaError(f"cluster {text!r}: `{key}` must be a number, but got {value!r}") from None
    if key == "comm_profile":
        return value if value and value.lower() != "none" else None
    return value


def _parse_pairs(items: Sequence[str], text: str) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for item in items:
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not key:
            raise SchemaError(f"cluster {text!r}: expected key=value, but got {item!r} (e.g. nodes=2,gpus_per_node=8)")
        if key not in _PARSE_KEYS:
            raise SchemaError(f"cluster {text!r}: unknown key {key!r}; known keys: {', '.join(sorted(_PARSE_KEYS))}")
        if key in values:
            raise SchemaError(f"cluster {text!r}: key {key!r} is given twice")
        values[key] = _parse_value(key, value, text)
    return values


def _spec_file(path: str) -> ClusterSpec:
    return ClusterSpec.from_dict(read_json(path, "cluster"), f"cluster file {path}")


def parse_cluster(text: str) -> ClusterSpec:
    """A cluster from the command line: a preset, a JSON file, key=value pairs, `PRESET,key=value,...`, or
    `profile=PATH[,key=value,...]` (the links of a measured profile, see `spec_from_profile`).

    `world_size=W` re-shapes the result with `ClusterSpec.with_world_size`.
    """
    raw = text.strip()
    known = ", ".join(PRESETS)
    if not raw:
        raise SchemaError(f"empty cluster: give a preset ({known}), a JSON file, or key=value pairs")
    if is_file(raw):
        return _spec_file(raw)
    head, *rest = (item.strip() for item in raw.split(","))
    base: ClusterSpec | None = None
    if "=" in head:
        rest = [head, *rest]
    elif head in PRESETS:
        base = PRESETS[head]
    elif head.lower().endswith(".json") or os.sep in head or is_file(head):
        base = _spec_file(head)
    else:
        raise SchemaError(
            f"unknown cluster preset {head!r}; known presets: {known}; or give a JSON file or key=value pairs "
            f"({', '.join(_LINK_FIELDS)})"
        )
    values = _parse_pairs(rest, raw)
    profile_path = values.pop("profile", None)
    world = values.pop("world_size", None)
    if profile_path is not None:
        if base is not None:
            raise SchemaError(f"cluster {raw!r}: give a preset, a file or profile=PATH, not two of them")
        base = spec_from_profile(Profile.load(profile_path), profile_path)
    try:
        if base is None:
            missing = [k for k in _LINK_FIELDS if k not in values]
            if missing:
                raise SchemaError(
                    f"missing key(s) {', '.join(missing)}: key=value clusters need all of {', '.join(_LINK_FIELDS)}"
                    f" (or start from a preset: {known})"
                )
            spec = ClusterSpec(**values)
        else:
            spec = replace(base, **values)
        return spec if world is None else spec.with_world_size(world)
    except SchemaError as exc:
        raise SchemaError(f"cluster {raw!r}: {exc}") from None


def parse_world_sizes(text: str) -> list[int]:
    """World sizes from "8,64,512" or a geometric "4,8,...,1024" (ratio of the first two terms, last included)."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip():
        raise SchemaError("no world sizes given: write e.g. 8,64,512 or 4,8,...,1024")

    def number(item: str) -> int:
        try:
            value = int(item)
        except ValueError:
            raise SchemaError(f"world sizes {text!r}: {item!r} is not an integer (write e.g. 4,8,...,1024)") from None
        if not 1 <= value <= MAX_WORLD_SIZE:
            shown = value if len(str(value)) <= 20 else f"a {len(str(value))}-digit number"
            raise SchemaError(f"world sizes {text!r}: `1 <= world_size <= {MAX_WORLD_SIZE}` must hold, but got {shown}")
        return value

    if "..." not in items:
        return [number(item) for item in items]
    at = items.index("...")
    if items.count("...") > 1 or at < 2 or at != len(items) - 2:
        raise SchemaError(f"world sizes {text!r}: write the ellipsis as FIRST,SECOND,...,LAST (e.g. 4,8,...,1024)")
    head, last = [number(item) for item in items[:at]], number(items[-1])
    if last < head[-1]:
        raise SchemaError(f"world sizes {text!r}: the last term {last} is below {head[-1]}; write them increasing")
    ratio, remainder = divmod(head[1], head[0])
    if remainder or ratio < 2:
        raise SchemaError(
            f"world sizes {text!r}: `SECOND / FIRST` must be an integer >= 2, but got {head[1]}/{head[0]}"
        )
    if head != [head[0] * ratio**i for i in range(len(head))]:
        raise SchemaError(f"world sizes {text!r}: {head} is not geometric with ratio {ratio}")
    sizes = [head[0]]
    while sizes[-1] < last:
        sizes.append(sizes[-1] * ratio)
    if sizes[-1] != last:
        raise SchemaError(
            f"world sizes {text!r}: the last term {last} is not reached exactly: ratio {ratio} goes from "
            f"{sizes[-2]} to {sizes[-1]}"
        )
    return sizes


# -- scaling ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ScalingRow:
    """The plan, its baselines and its lower bound at one world size (predicted seconds per iteration or step)."""

    world_size: int
    nodes: int
    gpus_per_node: int
    plan_s: float
    baselines: dict[str, float]
    lower_bound_s: float


def scaling_table(
    profile: Profile,
    spec: ClusterSpec,
    world_sizes: Iterable[int],
    *,
    strategy: str = "dense",
    density: float | None = None,
    method: InverseMethod = InverseMethod.EIGEN,
    factor_update_steps: int = DEFAULT_FACTOR_UPDATE_STEPS,
    inv_update_steps: int = DEFAULT_INV_UPDATE_STEPS,
    time_limit_s: float = 1.0,
    on_row: Callable[[ScalingRow], None] | None = None,
) -> list[ScalingRow]:
    """Plan `profile` on `spec` re-shaped to each world size; one row per world size, in the order given.

    `strategy` is "dense", "topk" (density 0.01 unless given) or "kfac". `on_row` is called after each row.
    """
    choices = ("dense", "topk", "kfac")
    if strategy not in choices:
        raise SchemaError(f"`strategy in {choices}` must hold, but got (strategy={strategy!r})")
    rows = []
    for world in world_sizes:
        shaped = spec.with_world_size(world)
        what_if = profile_for_cluster(profile, shaped)
        source = f"what-if {shaped.name}"
        if strategy == "kfac":
            plan = make_kfac_plan(what_if, method=method, factor_update_steps=factor_update_steps,
                                  inv_update_steps=inv_update_steps, time_limit_s=time_limit_s, source=source)
            section = plan.kfac
            assert section is not None and section.predicted is not None and section.lower_bound_s is not None
            plan_s = float(section.predicted.step_s)
            baselines = {name: float(p.step_s) for name, p in (section.baselines or {}).items()}
            bound = float(section.lower_bound_s)
        else:
            kind = Strategy(strategy)
            rho = (0.01 if density is None else density) if kind is Strategy.TOPK else None
            plan = make_plan(what_if, kind, rho, source=source)
            plan_s = float(plan.predicted.iteration_s)
            baselines = {name: float(p.iteration_s) for name, p in plan.baselines.items()}
            bound = float(plan.lower_bound_s)
        row = ScalingRow(world_size=shaped.world_size, nodes=shaped.nodes, gpus_per_node=shaped.gpus_per_node,
                         plan_s=plan_s, baselines=baselines, lower_bound_s=bound)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows
