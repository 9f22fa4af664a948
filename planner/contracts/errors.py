"""Compression error: how far each compressor moved each layer's gradients in real steps, as measured by
`planner profile` (`profilers.errors`) and recorded in the profile.

Schema (inside the profile, version 1 like it; absent or null: not measured, as in profiles written before it was).
Squared norms per rank, layer (ready order, the profile's layers) and measured step, float64:

    "errors": {
      "warmup": 2,                                  # steps run first and not recorded (error feedback builds up)
      "layers": ["fc3", "fc2", ...],                # the profile's layers, in its order
      "grad_sq": [[[s, s, ...], ...], ...],         # |g|^2: [rank][layer][step]
      "compressors": {
        "fp16":       {"input_sq": [...], "error_sq": [...]},   # |x|^2 and |C(x) - x|^2, x = g + the error fed
        "powersgd:4": {...}, "topk:0.01": {...}                 # back (fp16: x = g), as `ErrorMeter` measures
      }
    }

What the planner reads from it (`planner.kernels.error` says what each number is):

- a layer's contraction under compressor c: w_c = sum |C(x) - x|^2 / sum |x|^2 over ranks and steps, the 1 - delta
  of a delta-compressor on the inputs it met (0: exact; 1: sends nothing of it);
- a layer's weight: its share of the gradient's energy, a_l = mean |g_l|^2 / sum over layers of mean |g|^2;
- the error of sending layer l by c_l, every layer: E = sum_l a_l w_{c_l}(l), the contraction of the whole gradient
  when each layer's input is as large as its gradient. Error-feedback SGD's bounds grow with the whole vector's
  1 - delta (Stich and Karimireddy 2019), and weighing layers by energy is L-GreCo's sum of absolute errors divided
  by a constant. A top-k group merged over several layers keeps the k largest of their union, which leaves at most
  the sum of what each layer's own top-k at the same density leaves: E is an upper bound for merged groups.

Uncertainty: `interval` draws the measured steps with replacement (per rank, the same draw for every layer and
compressor) and recomputes; the central 90% of the draws.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.contracts.jsonio import check_fields, expect, expect_int
from planner.contracts.plan import parse_compressor
from planner.types import Compressor, CompressorKind, InvalidProfileError

__all__ = ["DEFAULT_ERROR_DRAWS", "MAX_CONTRACTION", "MAX_ERROR_STEPS", "MAX_SQUARED_NORM", "CompressionErrors"]

#: The most steps (warm-up and measured, each) a record may hold (a bound for reading files).
MAX_ERROR_STEPS = 10_000
#: Draws of the measured steps behind `CompressionErrors.interval`.
DEFAULT_ERROR_DRAWS = 200
#: Largest squared norm a record may hold. The meters square fp32 tensors (entries below 3.5e38, so squares below
#: 1.2e77) of at most 2^48 elements (`MAX_NUMEL`): no measurement reaches 4e91. The bound keeps every sum the planner
#: forms over ranks, layers and steps far from float64's overflow (1.8e308).
MAX_SQUARED_NORM = 1e100
#: The largest contraction `CompressionErrors.contraction` reports. The compressors move at most what they are given
#: (|C(x) - x| <= |x|, up to rounding), so real records stay near or below 1; the cap only keeps a ratio of a large
#: error to a vanishing input (1e100 / 1e-300) finite instead of overflowing.
MAX_CONTRACTION = 1e6


@dataclass(frozen=True, kw_only=True, eq=False)
class CompressionErrors:
    """The squared norms `planner profile` measured per rank, layer and step (see the module docstring).

    Attributes:
        layers: the layers, in the profile's (ready) order.
        warmup: steps run before the measured ones.
        grad_sq: |g|^2, shape (ranks, layers, steps).
        input_sq, error_sq: per compressor (its text, "topk:0.01"), |x|^2 and |C(x) - x|^2, the same shape.
    """

    layers: tuple[str, ...]
    warmup: int
    grad_sq: np.ndarray
    input_sq: Mapping[str, np.ndarray]
    error_sq: Mapping[str, np.ndarray]

    def __post_init__(self) -> None:
        shape = self.grad_sq.shape
        if len(shape) != 3 or shape[1] != len(self.layers) or min(shape) < 1:
            raise InvalidProfileError(f"profile.errors.grad_sq must be [rank][layer][step] over the {len(self.layers)} "
                                      f"layers, with at least one rank and step; got shape {list(shape)}")
        if len(set(self.layers)) != len(self.layers):
            raise InvalidProfileError("profile.errors.layers names a layer twice")
        if set(self.input_sq) != set(self.error_sq):
            raise InvalidProfileError("profile.errors: every compressor has both input_sq and error_sq")
        for name, array in (("grad_sq", self.grad_sq), *((f"compressors.{c}.input_sq", a)
                                                         for c, a in self.input_sq.items()),
                            *((f"compressors.{c}.error_sq", a) for c, a in self.error_sq.items())):
            if array.shape != shape:
                raise InvalidProfileError(f"profile.errors.{name} has shape {list(array.shape)}, expected "
                                          f"{list(shape)} (ranks, layers, steps)")
            if not (np.all(np.isfinite(array)) and np.all(array >= 0) and np.all(array <= MAX_SQUARED_NORM)):
                raise InvalidProfileError(f"profile.errors.{name} must hold finite squared norms >= 0 and at most "
                                          f"{MAX_SQUARED_NORM:g} (no measurement is larger): profile again")
        for c in self.input_sq:
            compressor = parse_compressor(c, f"profile.errors.compressors[{c!r}]")
            if _exact(compressor) or str(compressor) != c:
                raise InvalidProfileError(f"profile.errors.compressors[{c!r}]: expected a compressor that changes what "
                                          f"it sends, written as planner writes it ({compressor})")

    @property
    def compressors(self) -> tuple[Compressor, ...]:
        """The compressors measured."""
        return tuple(Compressor.parse(c) for c in self.input_sq)

    @property
    def steps(self) -> int:
        """Measured steps per rank."""
        return int(self.grad_sq.shape[2])

    @property
    def ranks(self) -> int:
        return int(self.grad_sq.shape[0])

    def has(self, compressor: Compressor | str) -> bool:
        """Whether `compressor` was measured (dense and top-k at density 1 always are: their error is 0)."""
        c = _parse(compressor)
        return _exact(c) or str(c) in self.input_sq

    # -- what the planner reads ------------------------------------------------------------------
    def weights(self, take: np.ndarray | None = None) -> np.ndarray:
        """Each layer's share of the gradient's energy (sums to 1; all 0 if no layer had a gradient). `take`: the
        steps drawn per rank (`interval`), else all."""
        energy = _mean(self.grad_sq, take)
        total = energy.sum()
        return energy / total if total > 0 else np.zeros_like(energy)

    def contraction(self, compressor: Compressor | str, take: np.ndarray | None = None) -> np.ndarray:
        """Per layer: sum |C(x) - x|^2 / sum |x|^2 under `compressor` (0 for dense, and where x was 0)."""
        c = self._measured(compressor)
        if c is None:
            return np.zeros(len(self.layers))
        err, inp = _mean(self.error_sq[c], take), _mean(self.input_sq[c], take)
        # err / max(inp, err / MAX_CONTRACTION): the ratio, at most MAX_CONTRACTION, with no quotient that overflows
        return np.divide(err, np.maximum(inp, err / MAX_CONTRACTION), out=np.zeros_like(err), where=inp > 0)

    def layer_errors(self, compressor: Compressor | str, take: np.ndarray | None = None) -> np.ndarray:
        """Per layer: what sending it by `compressor` adds to the plan's error, a_l w_c(l)."""
        return self.weights(take) * self.contraction(compressor, take)

    def error_of(self, choice: Sequence[Compressor | str], take: np.ndarray | None = None) -> float:
        """The error of sending layer l by `choice[l]`, every layer: sum_l a_l w_{c_l}(l)."""
        if len(choice) != len(self.layers):
            raise ValueError(f"one compressor per layer: {len(self.layers)} expected, got {len(choice)}")
        weights = self.weights(take)
        contractions: dict[str, np.ndarray] = {}
        total = 0.0
        for i, c in enumerate(choice):
            name = self._measured(c)
            if name is None:
                continue
            if name not in contractions:
                contractions[name] = self.contraction(name, take)
            total += float(weights[i] * contractions[name][i])
        return total

    def uniform(self, compressor: Compressor | str) -> float:
        """The error of sending every layer by `compressor`."""
        return float(self.layer_errors(compressor).sum())

    def draws(self, count: int = DEFAULT_ERROR_DRAWS, seed: int = 0) -> list[np.ndarray]:
        """`count` draws of the measured steps with replacement, per rank: arrays (ranks, steps) of step indices."""
        rng = np.random.default_rng(seed)
        return [rng.integers(0, self.steps, size=(self.ranks, self.steps)) for _ in range(count)]

    def interval(self, choice: Compressor | str | Sequence[Compressor | str], *, count: int = DEFAULT_ERROR_DRAWS,
                 seed: int = 0) -> tuple[float, float]:
        """The central 90% of the error of `choice` (one compressor for every layer, or one per layer) over draws
        of the measured steps."""
        per_layer = [choice] * len(self.layers) if isinstance(choice, Compressor | str) else list(choice)
        values = [self.error_of(per_layer, take) for take in self.draws(count, seed)]
        low, high = np.quantile(values, [0.05, 0.95])
        return float(low), float(high)

    def grad_spread(self) -> np.ndarray:
        """Per layer: the coefficient of variation of |g| over steps and ranks (std / mean; 0 where |g| was 0)."""
        flat = np.sqrt(self.grad_sq).transpose(1, 0, 2).reshape(len(self.layers), -1)
        mean = flat.mean(axis=1)
        return np.divide(flat.std(axis=1), mean, out=np.zeros_like(mean), where=mean > 0)

    def _measured(self, compressor: Compressor | str) -> str | None:
        """The key of `compressor`'s measurements; None for dense; KeyError naming what was measured otherwise."""
        c = _parse(compressor)
        if _exact(c):
            return None
        if str(c) not in self.input_sq:
            measured = ", ".join(self.input_sq) or "none"
            raise KeyError(f"the profile measured no compression error for {c} (measured: {measured}); profile "
                           f"again with it allowed")
        return str(c)

    # -- serialisation -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"warmup": self.warmup, "layers": list(self.layers), "grad_sq": self.grad_sq.tolist(),
                "compressors": {c: {"input_sq": self.input_sq[c].tolist(), "error_sq": self.error_sq[c].tolist()}
                                for c in self.input_sq}}

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile.errors") -> CompressionErrors:
        expect(data, dict, where)
        check_fields(data, where, ["warmup", "layers", "grad_sq", "compressors"])
        layers = tuple(expect(n, str, f"{where}.layers[]") for n in expect(data["layers"], list, f"{where}.layers"))
        compressors = expect(data["compressors"], dict, f"{where}.compressors")
        input_sq, error_sq = {}, {}
        for c, both in compressors.items():
            at = f"{where}.compressors[{c!r}]"
            expect(both, dict, at)
            check_fields(both, at, ["input_sq", "error_sq"])
            input_sq[c] = _array(both["input_sq"], f"{at}.input_sq")
            error_sq[c] = _array(both["error_sq"], f"{at}.error_sq")
        return cls(layers=layers, warmup=expect_int(data["warmup"], f"{where}.warmup", 0, MAX_ERROR_STEPS,
                                                    InvalidProfileError),
                   grad_sq=_array(data["grad_sq"], f"{where}.grad_sq"), input_sq=input_sq, error_sq=error_sq)


def _parse(compressor: Compressor | str) -> Compressor:
    return compressor if isinstance(compressor, Compressor) else Compressor.parse(compressor)


def _exact(c: Compressor) -> bool:
    """Whether `c` sends its input unchanged (dense, top-k at density 1): error 0, not measured."""
    return c.kind is CompressorKind.DENSE or (c.kind is CompressorKind.TOPK and c.density is not None
                                              and c.density >= 1)


def _mean(array: np.ndarray, take: np.ndarray | None) -> np.ndarray:
    """Per layer: the mean over ranks and steps of `array` (ranks, layers, steps), or over the steps `take` draws
    per rank (ranks, draws)."""
    if take is not None:
        array = np.take_along_axis(array, take[:, None, :].repeat(array.shape[1], axis=1), axis=2)
    return array.mean(axis=(0, 2))


def _array(value: Any, where: str) -> np.ndarray:
    """A [rank][layer][step] list of finite numbers >= 0 as a float64 array (its shape is checked by the class)."""
    expect(value, list, where)
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidProfileError(f"{where} must be a [rank][layer][step] list of numbers") from None
    if array.ndim != 3 or array.shape[2] > MAX_ERROR_STEPS or not math.prod(array.shape):
        raise InvalidProfileError(f"{where} must be a non-empty [rank][layer][step] list of numbers, at most "
                                  f"{MAX_ERROR_STEPS} steps")
    return array
