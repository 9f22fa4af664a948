"""Reading and writing the planner's JSON documents: clear errors on the way in, atomic on the way out."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from planner.types import PlannerFileError, SchemaError

#: Where commands write by default (the demo's profiles and plans, retune's plan): a folder of the user's, listed in
#: the repository's .gitignore, never one the repository ships (its plans/ holds example plans).
RUNS = Path("runs")

#: No plan or profile comes near this size (those of a 5000-layer model with K-FAC are a few MB): a
#: larger file is refused before it is read.
MAX_DOCUMENT_BYTES = 64 * 1024 * 1024
#: No field of a plan or profile needs an integer of more digits (element counts stay below 2^48).
MAX_INT_DIGITS = 30
#: Longest time any field may hold, in seconds (11.6 days); larger ones are mistakes and overflow later.
MAX_SECONDS = 1e6
#: Most elements a layer, group or model may have (2^48; the largest models have about 2^40).
MAX_NUMEL = 2**48
#: Largest world size any command or document accepts.
MAX_WORLD_SIZE = 2**20


def is_file(path: str | os.PathLike[str]) -> bool:
    """`Path.is_file`, but False (not OSError) for a name the file system cannot hold, such as one longer
    than it allows: a command-line value that may or may not be a path asks this."""
    try:
        return Path(path).is_file()
    except OSError:
        return False


def read_json(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """Parse a JSON object from `path`; `what` ("plan", "profile") names the document in errors. Files over
    `MAX_DOCUMENT_BYTES`, nesting deeper than Python's parser follows and integers longer than
    `MAX_INT_DIGITS` are refused with a SchemaError / PlannerFileError, never the parser's own error."""
    data = read_json_value(path, what)
    if not isinstance(data, dict):
        raise SchemaError(f"{what} file {path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_json_value(path: str | os.PathLike[str], what: str) -> Any:
    """Any JSON value from `path`, read with the guards of `read_json`: a regular file (a FIFO would wait
    forever), at most `MAX_DOCUMENT_BYTES`, bounded nesting and integers."""
    p = Path(path)
    try:
        found = p.is_file()
    except OSError as exc:  # a name longer than the file system allows, for one
        raise PlannerFileError(f"cannot read {what} file {p}: {exc.strerror} (check the path)") from None
    if not found and p.exists():  # a folder, or a FIFO or device that reading would wait on forever
        raise PlannerFileError(f"{what} file {p} is not a regular file: give a file written by planner")
    if not found:
        raise PlannerFileError(f"{what} file not found: {p} (check the path)")
    try:
        size = p.stat().st_size
        if size > MAX_DOCUMENT_BYTES:
            raise PlannerFileError(f"{what} file {p} is {size / 2**20:,.0f} MiB; no {what} is over "
                                   f"{MAX_DOCUMENT_BYTES // 2**20} MiB: give a file written by planner")
        text = p.read_text(encoding="utf-8")
    except PlannerFileError:
        raise
    except (OSError, UnicodeDecodeError) as exc:
        raise PlannerFileError(f"cannot read {what} file {p}: {exc}") from exc
    try:
        # parse_constant turns NaN/Infinity into a schema error instead of a float; parse_int refuses
        # integers no field can hold before Python converts them.
        data = json.loads(text, parse_constant=_reject_constant, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise SchemaError(
            f"{what} file {p} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno});"
            f" the file may be truncated: produce it again"
        ) from exc
    except SchemaError as exc:
        raise SchemaError(f"{what} file {p}: {exc}") from None
    except RecursionError:
        raise SchemaError(f"{what} file {p} nests arrays or objects too deeply to be a {what} file: "
                          "give a file written by planner") from None
    except ValueError as exc:  # a number Python cannot convert
        raise SchemaError(f"{what} file {p} holds a number no {what} field can: {exc}") from None
    return data


def _reject_constant(name: str) -> Any:
    raise SchemaError(f"non-finite number {name} in JSON document")


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise SchemaError(f"an integer of {digits} digits in JSON document; no field holds more than "
                          f"{MAX_INT_DIGITS} digits")
    return int(text)


def check_output_path(path: str | os.PathLike[str], what: str = "file") -> Path:
    """The path an atomic write may replace, or PlannerFileError: an empty name, an existing target that is not a
    regular file (a directory, a device such as /dev/full, a pipe; a rename would replace it), a parent that is not
    a folder, or a folder no file can be created in. Commands call it before their work, so that minutes of
    measuring or training are not lost to a path they cannot write."""
    if not str(path).strip():
        raise PlannerFileError(f"the {what} path is empty; give a file name")
    p = Path(path)
    try:
        if (p.is_symlink() or p.exists()) and not p.is_file():
            raise PlannerFileError(f"refusing to write the {what} over {p}: it exists and is not a regular file; "
                                   "give the path of a file")
        for parent in p.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise PlannerFileError(f"cannot write the {what} {p}: {parent} is not a folder")
                _check_writable(parent, p, what)
                break
    except OSError as exc:
        if isinstance(exc, PlannerFileError):
            raise
        raise PlannerFileError(f"cannot write the {what} {p}: {exc.strerror or exc}") from exc
    return p


def _check_writable(folder: Path, path: Path, what: str) -> None:
    """Create and remove a file in `folder` (the target's, or the nearest that exists, where the write creates the
    rest): what the atomic write does first. Permission bits do not tell (root passes `os.access` in /proc, where
    nothing can be created; a read-only mount keeps its bits), so it is tried."""
    try:
        fd, name = tempfile.mkstemp(prefix=".planner-check.", dir=folder)
    except OSError as exc:
        raise PlannerFileError(f"cannot write the {what} {path}: no file can be created in {folder} "
                               f"({exc.strerror or exc}); give a path in a folder you can write") from None
    os.close(fd)
    os.unlink(name)


def ensure_folder(path: str | os.PathLike[str], what: str = "output folder", *, create: bool = True) -> Path:
    """Create the folder `path` (with its parents) if needed; PlannerFileError in one line if it cannot be one.
    With `create=False`, only the checks: a command asks early, and creates once its inputs are read."""
    if not str(path).strip():
        raise PlannerFileError(f"the {what} path is empty; give a folder")
    p = Path(path)
    try:
        if p.exists() and not p.is_dir():
            raise PlannerFileError(f"the {what} {p} exists and is not a folder; give a folder path")
        if create:
            p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if isinstance(exc, PlannerFileError):
            raise
        raise PlannerFileError(f"cannot create the {what} {p}: {exc.strerror or exc}") from exc
    return p


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], object], what: str = "file") -> Path:
    """Call `write(tmp)` on a temporary file beside `path` (same suffix), then rename it to `path`: a crash or an
    error leaves `path` as it was. Errors of the file system become one PlannerFileError line."""
    p = check_output_path(path, what)
    tmp: Path | None = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{p.stem[:40]}.", suffix=p.suffix[:20] or ".tmp", dir=p.parent)
        os.close(fd)
        tmp = Path(name)
        tmp.chmod(0o644)  # readable like any other file written here (mkstemp makes it private)
        write(tmp)
        os.replace(tmp, p)
    except OSError as exc:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        reason = exc.strerror or str(exc)
        raise PlannerFileError(f"cannot write the {what} {p}: {reason}") from exc
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise
    return p


def write_json_atomic(path: str | os.PathLike[str], data: Mapping[str, Any], what: str = "file") -> Path:
    """Write `data` as JSON to `path` through a temporary file and a rename, so a crash loses nothing."""
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    return atomic_write(path, write, what)


def check_fields(data: Mapping[str, Any], where: str, required: Iterable[str], optional: Iterable[str] = ()) -> None:
    """Reject unknown and missing fields, naming them."""
    req, opt = set(required), set(optional)
    unknown = sorted(set(data) - req - opt)
    if unknown:
        raise SchemaError(f"unknown field(s) {unknown} in {where}; allowed: {sorted(req | opt)}")
    missing = sorted(req - set(data))
    if missing:
        raise SchemaError(f"missing field(s) {missing} in {where}")


def expect(value: Any, kind: type | tuple[type, ...], where: str) -> Any:
    """Return `value` if it has JSON type `kind` (bool is never an int here), else raise naming `where`."""
    ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _as_tuple(kind))
    if not ok:
        names = "/".join(k.__name__ for k in _as_tuple(kind))
        raise SchemaError(f"{where} must be {names}, got {value!r}")
    return value


def expect_time(value: Any, where: str, error: type[SchemaError] = SchemaError) -> float:
    """A duration in seconds: a finite number in [0, MAX_SECONDS] (else `error`)."""
    v = float(expect(value, (int, float), where))
    if not math.isfinite(v) or not 0 <= v <= MAX_SECONDS:
        raise error(f"{where} must be a time between 0 and {MAX_SECONDS:g} seconds, got {value!r}")
    return v


def expect_int(value: Any, where: str, low: int, high: int, error: type[SchemaError] = SchemaError) -> int:
    """An integer in [low, high] (else `error`, naming `where` and the bounds)."""
    v = expect(value, int, where)
    if not low <= v <= high:
        raise error(f"{where} must be an integer between {low:,} and {high:,}, got {v:,}")
    return int(v)


def expect_interval(value: Any, where: str) -> tuple[float, float]:
    """[low, high] in seconds, low <= high (else a SchemaError naming `where`)."""
    if not isinstance(value, list) or len(value) != 2:
        raise SchemaError(f"{where} must be [low, high] in seconds, got {value!r}")
    low, high = (expect_time(v, f"{where}[{i}]") for i, v in enumerate(value))
    if low > high:
        raise SchemaError(f"{where}: `low <= high` must hold, but got (low={low}, high={high})")
    return low, high


def expect_gain(value: Any, where: str) -> tuple[float, float, float]:
    """A gain's [median, low, high]: 1 - plan / alternative, finite and at most 1, low <= median <= high (else a
    SchemaError naming `where`)."""
    gain = expect(value, list, where)
    if len(gain) != 3 or not all(isinstance(g, int | float) and not isinstance(g, bool) and math.isfinite(g)
                                 and -1e6 < g <= 1 for g in gain):
        raise SchemaError(f"{where} must be [median, low, high], finite gains (1 - plan / alternative) at most 1, "
                          f"got {value!r}")
    if not gain[1] <= gain[0] <= gain[2]:
        raise SchemaError(f"{where}: `low <= median <= high` must hold, but got {gain}")
    return float(gain[0]), float(gain[1]), float(gain[2])


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)
