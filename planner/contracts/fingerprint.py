"""Fingerprints of the model and the cluster a profile or plan was made for."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from planner.contracts.jsonio import MAX_NUMEL, MAX_WORLD_SIZE, check_fields, expect, expect_int
from planner.types import PlannerError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ClusterInfo", "ModelInfo", "model_info"]


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """Which model: a hash of its trainable parameters' names, shapes and dtypes, plus readable counts."""

    name: str
    fingerprint: str
    num_params: int
    numel: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "model") -> ModelInfo:
        expect(data, dict, where)
        check_fields(data, where, ["name", "fingerprint", "num_params", "numel"])
        return cls(
            name=expect(data["name"], str, f"{where}.name"),
            fingerprint=expect(data["fingerprint"], str, f"{where}.fingerprint"),
            num_params=expect_int(data["num_params"], f"{where}.num_params", 1, MAX_NUMEL),
            numel=expect_int(data["numel"], f"{where}.numel", 1, MAX_NUMEL),
        )

    def describe(self) -> str:
        return (
            f"{self.name} ({self.num_params} parameter tensors, {self.numel:,} elements, "
            f"fingerprint {self.fingerprint})"
        )


@dataclass(frozen=True, kw_only=True)
class ClusterInfo:
    """Where: world size, backend, device name, number of hosts, and the emulated link if any.

    `link` is the rate of the emulated slower network the workers ran behind (`--link 1gbit`, see
    `planner.platform.link`), or None for the real network (loopback for local workers). Documents written before
    it existed have no `link` field and read as None. `slowdown` is the `--slowdown` the local workers ran
    with (`1=2`: rank 1 under a CPU quota, about 2x slower; see `planner.platform.slowdown`), or None.
    """

    world_size: int
    backend: str
    device: str
    host_count: int = 1
    link: str | None = None
    slowdown: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.slowdown is None:  # documents without slowed workers stay as they were
            del out["slowdown"]
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "cluster") -> ClusterInfo:
        expect(data, dict, where)
        check_fields(data, where, ["world_size", "backend", "device", "host_count"], optional=["link", "slowdown"])
        link, slowdown = data.get("link"), data.get("slowdown")
        world_size = expect_int(data["world_size"], f"{where}.world_size", 1, MAX_WORLD_SIZE)
        return cls(
            world_size=world_size,
            backend=expect(data["backend"], str, f"{where}.backend"),
            device=expect(data["device"], str, f"{where}.device"),
            host_count=expect_int(data["host_count"], f"{where}.host_count", 1, world_size),
            link=None if link is None else expect(link, str, f"{where}.link"),
            slowdown=None if slowdown is None else expect(slowdown, str, f"{where}.slowdown"),
        )

    def describe(self) -> str:
        where = f" behind an emulated {self.link} link" if self.link else ""
        slowed = f", workers slowed {self.slowdown}" if self.slowdown else ""
        hosts = f" on {self.host_count} hosts" if self.host_count > 1 else ""
        return f"world size {self.world_size}{hosts}, {self.backend} on {self.device}{where}{slowed}"

    @property
    def device_kind(self) -> str:
        """"cpu" or "gpu": what the runtime can check (device names differ between profiles of one kind)."""
        return "cpu" if self.device.lower().startswith("cpu") else "gpu"


def check_dense_gradients(module: nn.Module) -> None:
    """PlannerError naming the first trainable parameter whose gradient is sparse (`nn.Embedding(...,
    sparse=True)`, `nn.EmbeddingBag(..., sparse=True)`): every exchange here packs gradients into flat dense
    buffers, which a sparse tensor has no storage for."""
    seen: set[int] = set()
    for mname, mod in module.named_modules():
        if getattr(mod, "sparse", False) is not True:
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                full = f"{mname}.{pname}" if mname else pname
                raise PlannerError(
                    f"parameter {full!r} gets sparse gradients ({type(mod).__name__}(..., sparse=True)); the "
                    f"planner exchanges dense gradients only: build the module with sparse=False (DDP then "
                    f"allreduces it densely too)")
            seen.add(id(p))


def model_info(module: nn.Module, name: str) -> ModelInfo:
    """Fingerprint `module` from its trainable parameters (registration order), identically on every rank.

    A model with sparse gradients is refused here (see `check_dense_gradients`), so the profile, the plans,
    the runtime and the benches all refuse it in the same line.
    """
    check_dense_gradients(module)
    h = hashlib.sha256()
    count = numel = 0
    for pname, p in module.named_parameters():
        if not p.requires_grad:
            continue
        h.update(f"{pname}:{tuple(p.shape)}:{p.dtype}\n".encode())
        count += 1
        numel += p.numel()
    return ModelInfo(name=name, fingerprint=h.hexdigest()[:16], num_params=count, numel=numel)
