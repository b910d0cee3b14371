"""Read a finished run's logged metrics back: a Lightning CSV logger folder, a W&B offline run,
or TensorBoard event files, into one :class:`RunLog`.

Runs from every loop normscope runs in read the same: the Lightning and Fabric loggers, a plain
loop's ``wandb.log``, and the Hugging Face ``Trainer``, whose W&B and TensorBoard integrations
log every key under ``train/`` (``train/dd/...``) and, on W&B, the step as
``train/global_step``. normscope's keys are read without that prefix (``RunLog.key_prefix``
says it was there) and every row's ``"step"`` is the trainer's global step, never W&B's own
``_step`` counter.

The W&B reader parses the run's local transaction file (``run-<id>.wandb``) itself: the file is a
LevelDB-log-format stream (32 KiB blocks of CRC-checked chunks) of protobuf ``Record`` messages,
which ``wandb.proto.wandb_internal_pb2`` describes. Nothing is unpickled and no network is used.

Example::

    >>> from normscope.runs import read_run  # doctest: +SKIP
    >>> run = read_run("wandb/offline-run-20261203_053541-v1nliibm")  # doctest: +SKIP
    >>> steps, ratio = run.series("dd/sigma_min_ratio_min")  # doctest: +SKIP
    >>> run.alerts[0]["title"]  # doctest: +SKIP
    'normscope: sigma_min_collapse'
"""

from __future__ import annotations

import csv
import json
import math
import re
import struct
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from normscope._common import NormscopeError

__all__ = [
    "RunLog",
    "RunReadError",
    "SkippedBytes",
    "read_csv_run",
    "read_run",
    "read_tensorboard_run",
    "read_wandb_run",
    "wandb_records",
]

_BLOCK = 32768
_CHUNK_HEADER = 7  # crc32 (4) + length (2) + type (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_WANDB_HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
# The trainer's global step, as each writer logs it: Lightning's WandbLogger, the Hugging Face
# Trainer's W&B integration, a user's own ``step`` key; W&B's ``_step`` counts rows instead.
_STEP_KEYS = ("trainer/global_step", "train/global_step", "step", "_step")
# A normscope key (``dd/``, ``sm/``, ``dd[name]/``, ``dd.<source>/``...) under the Hugging Face
# Trainer's ``train/`` prefix (its ``rewrite_logs``, for W&B and TensorBoard alike).
_HF_PREFIX = "train/"
_HF_FAMILY_KEY = re.compile(r"^train/(?:dd|sm)(?:\[[^\[\]/\s]+\])?(?:\.[^/]+)?/")
_AT_STEP = re.compile(r"\bat step (\d+)\b")


class RunReadError(NormscopeError, ValueError):
    """A path that is not a readable run (the message says what was expected)."""


@dataclass
class RunLog:
    """A run's logged scalars.

    Attributes:
        source: ``"csv"``, ``"wandb"`` or ``"tensorboard"``.
        path: the file or folder read.
        history: one dict per logged row, every value a float; each row has a ``"step"`` key
            (the trainer's global step where the logger recorded it).
        alerts: alert records in log order, each ``{"step", "title", "text", "level"}``
            (W&B runs only; CSV and TensorBoard have no alert records).
        skipped: the corrupt stretches of a W&B transaction file that were skipped
            (:func:`wandb_records`); empty for an intact file.
        summary: a W&B run's summary as its summary records left it (numbers, strings; media
            and nested values as W&B's JSON decodes them); empty for CSV and TensorBoard.
        key_prefix: ``"train/"`` when normscope's keys were logged under the Hugging Face
            Trainer's prefix (``train/dd/...``) and are read without it; else ``""``.
    """

    source: str
    path: Path
    history: list[dict[str, float]] = field(default_factory=list)
    alerts: list[dict[str, object]] = field(default_factory=list)
    skipped: list[SkippedBytes] = field(default_factory=list)
    summary: dict[str, object] = field(default_factory=dict)
    key_prefix: str = ""

    def __post_init__(self) -> None:
        self.key_prefix = self.key_prefix or _drop_trainer_prefix(self.history, self.summary)

    def keys(self) -> list[str]:
        """Every metric key logged at least once, sorted (``"step"`` excluded)."""
        return sorted({k for row in self.history for k in row} - {"step"})

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of one key over the rows that logged it, in log order."""
        rows = [row for row in self.history if key in row]
        steps = np.array([row["step"] for row in rows], dtype=np.float64)
        values = np.array([row[key] for row in rows], dtype=np.float64)
        return steps, values


def _drop_trainer_prefix(history: list[dict[str, float]], summary: dict[str, object]) -> str:
    """Rename ``train/dd/...`` (any normscope family under the Hugging Face Trainer's
    ``train/``) to ``dd/...`` in place, in every row and the summary, unless a row already holds
    the bare key; returns the prefix found (``"train/"``) or ``""``.

    Example::

        >>> rows = [{"train/dd/x": 1.0, "train/loss": 2.0, "step": 4.0}]
        >>> _drop_trainer_prefix(rows, {}), rows
        ('train/', [{'train/loss': 2.0, 'step': 4.0, 'dd/x': 1.0}])
    """
    found = ""
    for table in (*history, summary):
        for key in [k for k in table if _HF_FAMILY_KEY.match(k)]:
            bare = key[len(_HF_PREFIX) :]
            if bare not in table:
                table[bare] = table.pop(key)  # type: ignore[assignment]
                found = _HF_PREFIX
    return found


def read_run(path: str | Path) -> RunLog:
    """Read whatever run ``path`` holds: a W&B run folder or ``.wandb`` file, a folder with a
    ``metrics.csv`` (Lightning's CSVLogger), or a folder with TensorBoard event files."""
    p = Path(path)
    if not p.exists():
        raise RunReadError(f"no such file or folder: {p}")
    if p.is_file():
        if p.suffix == ".wandb":
            return read_wandb_run(p)
        if p.name.endswith(".csv"):
            return read_csv_run(p)
        if "tfevents" in p.name:
            return read_tensorboard_run(p.parent)
        raise RunReadError(f"{p}: not a .wandb, .csv or TensorBoard event file")
    if any(next(p.glob(g), None) for g in ("run-*.wandb", "*/run-*.wandb", "*/*/run-*.wandb")):
        return read_wandb_run(p)
    if list(p.rglob("metrics.csv")):
        return read_csv_run(p)
    if list(p.rglob("*tfevents*")):
        return read_tensorboard_run(p)
    raise RunReadError(
        f"{p}: found no run in it (looked for a W&B run-*.wandb file, a CSV logger's "
        "metrics.csv, TensorBoard *tfevents* files)"
    )


# ---------------------------------------------------------------------------------- CSV
def read_csv_run(path: str | Path) -> RunLog:
    """Lightning ``CSVLogger`` output: ``metrics.csv`` itself or a folder holding exactly one."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.rglob("metrics.csv"))
        if not found:
            raise RunReadError(f"{p}: no metrics.csv in this folder")
        if len(found) > 1:
            listing = ", ".join(str(f.relative_to(p)) for f in found[:6])
            raise RunReadError(f"{p}: several runs ({listing}); pass one version folder")
        p = found[0]
    history: list[dict[str, float]] = []
    with p.open(newline="") as fh:
        for raw in csv.DictReader(fh):
            row: dict[str, float] = {}
            for key, text in raw.items():
                if key is None or text in (None, ""):
                    continue
                try:
                    row[key] = float(text)
                except ValueError:
                    continue
            if "step" in row:
                history.append(row)
    return RunLog("csv", p, history)


# ---------------------------------------------------------------------------------- W&B
def _wandb_file(path: Path) -> Path:
    if path.is_file():
        return path
    # The run folder itself, W&B's save folder (``wandb/``), or the folder given to
    # WandbLogger(save_dir=...) that holds it; ``latest-run`` links a run already counted.
    found = sorted(path.glob("run-*.wandb"))
    for pattern in ("*/run-*.wandb", "*/*/run-*.wandb"):
        found = found or sorted(f for f in path.glob(pattern) if "latest-run" not in f.parts)
    found = sorted({f.resolve(): f for f in found}.values())
    if not found:
        raise RunReadError(f"{path}: no run-*.wandb transaction file in this folder")
    if len(found) > 1:
        listing = ", ".join(str(f.relative_to(path)) for f in found[:6])
        raise RunReadError(f"{path}: several W&B runs ({listing}); pass one run folder")
    return found[0]


@dataclass
class SkippedBytes:
    """What a corrupt stretch of a W&B transaction file cost: the bytes skipped (from ``start``
    to the next 32 KiB block, LevelDB's own recovery), the chunks dropped with them (the
    corrupt one and the orphaned parts of a record that straddled it) and why."""

    start: int
    end: int
    chunks_dropped: int
    reason: str

    @property
    def bytes_skipped(self) -> int:
        return self.end - self.start


def wandb_records(
    path: str | Path, *, strict: bool = False, skipped: list[SkippedBytes] | None = None
) -> Iterator[object]:
    """Every protobuf ``Record`` of a W&B transaction file, in order.

    A corrupt chunk (checksum mismatch, impossible length or type) does not end the read: as
    LevelDB's log reader does, the rest of its 32 KiB block is skipped, a record that straddled
    it is dropped whole, reading resumes at the next block, and one ``RuntimeWarning`` at the end
    says how many bytes and chunks were lost (each stretch is appended to ``skipped`` when
    given). ``strict=True`` raises :class:`RunReadError` at the first corrupt chunk instead.

    Raises :class:`RunReadError` on a file that is not a W&B transaction file (bad header).

    Example::

        >>> lost: list[SkippedBytes] = []  # doctest: +SKIP
        >>> records = list(wandb_records("run-x.wandb", skipped=lost))  # doctest: +SKIP
        >>> sum(s.bytes_skipped for s in lost)  # doctest: +SKIP
        32761
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if not data.startswith(_WANDB_HEADER):
        raise RunReadError(f"{path}: not a W&B transaction file (bad header)")
    lost: list[SkippedBytes] = []
    pos = len(_WANDB_HEADER)
    pending: bytearray | None = None  # the parts of a FIRST..LAST record read so far
    pending_chunks = 0

    def corrupt(reason: str) -> int:
        nonlocal pending, pending_chunks
        if strict:
            raise RunReadError(f"{path}: corrupt chunk at byte {pos} ({reason})")
        end = min(len(data), pos + _BLOCK - pos % _BLOCK)
        lost.append(SkippedBytes(pos, end, 1 + pending_chunks, reason))
        pending, pending_chunks = None, 0
        return end

    while pos + _CHUNK_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _CHUNK_HEADER:
            pos += left_in_block  # block trailer: zero padding
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        start = pos + _CHUNK_HEADER
        if kind == 0 and length == 0:
            pos += left_in_block  # zero-filled tail of a block
            continue
        if _CHUNK_HEADER + length > left_in_block:
            pos = corrupt(f"a chunk of {length} bytes cannot fit in its block")
            continue
        chunk = data[start : start + length]
        if len(chunk) < length:
            break  # a run still being written: the last chunk is partial
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            pos = corrupt("checksum mismatch")
            continue
        if kind not in (_FULL, _FIRST, _MIDDLE, _LAST):
            pos = corrupt(f"unknown chunk type {kind}")
            continue
        at, pos = pos, start + length
        if kind in (_MIDDLE, _LAST) and pending is None:
            # the rest of a record whose start was lost (or never written): dropped
            if not lost:
                lost.append(SkippedBytes(at, at, 0, "a record's continuation without its start"))
            lost[-1].chunks_dropped += 1
            continue
        if kind in (_FULL, _FIRST) and pending is not None:
            # a FIRST..LAST record cut short: its parts are dropped
            lost.append(SkippedBytes(at, at, pending_chunks, "a record without its last chunk"))
        if kind == _FULL:
            pending, pending_chunks = bytearray(chunk), 0
        elif kind == _FIRST:
            pending, pending_chunks = bytearray(chunk), 1
            continue
        elif kind == _MIDDLE:
            pending += chunk
            pending_chunks += 1
            continue
        else:  # _LAST
            pending += chunk
        record = pb.Record()
        record.ParseFromString(bytes(pending))
        pending, pending_chunks = None, 0
        yield record
    if lost:
        if skipped is not None:
            skipped.extend(lost)
        warnings.warn(
            f"normscope: {path}: {len(lost)} corrupt stretch(es) skipped, "
            f"{sum(s.bytes_skipped for s in lost)} bytes and "
            f"{sum(s.chunks_dropped for s in lost)} chunks lost (first at byte "
            f"{lost[0].start}: {lost[0].reason}); the records around them were read",
            RuntimeWarning,
            stacklevel=2,
        )


def _history_value(item: object) -> float | None:
    raw = getattr(item, "value_json", "")
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
        return float(value.replace("Infinity", "inf"))
    return None  # media, tables, histograms: not scalars


def read_wandb_run(path: str | Path) -> RunLog:
    """A W&B run (offline or synced) from its local ``run-<id>.wandb`` transaction file.

    Rows are the run's history records with their scalar items; ``"step"`` is the trainer's
    global step when the row logs it (Lightning's ``trainer/global_step``, the Hugging Face
    Trainer's ``train/global_step``, a ``step`` key), else W&B's ``_step`` (a plain loop's
    ``wandb.log(metrics, step=step)`` sets it to the step). An alert carries the step its text
    names (normscope's alerts say "at step N"), else that of the last history row written before
    it (W&B writes a row when the next step begins, so that one can be a step early)."""
    file = _wandb_file(Path(path))
    history: list[dict[str, float]] = []
    alerts: list[dict[str, object]] = []
    skipped: list[SkippedBytes] = []
    summary: dict[str, object] = {}
    for record in wandb_records(file, skipped=skipped):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row: dict[str, float] = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                value = _history_value(item)
                if value is not None:
                    row[key] = value
            step = next((row[k] for k in _STEP_KEYS if k in row), None)
            if step is None:
                step = float(record.history.step.num)
            row["step"] = step
            history.append(row)
        elif kind == "summary":
            for item in record.summary.update:
                key = item.key or "/".join(item.nested_key)
                try:
                    summary[key] = json.loads(item.value_json)
                except json.JSONDecodeError:
                    continue
            for item in record.summary.remove:
                summary.pop(item.key or "/".join(item.nested_key), None)
        elif kind == "alert":
            named = _AT_STEP.search(record.alert.text)
            if named:
                step = float(named.group(1))
            else:
                step = history[-1]["step"] if history else math.nan
            alerts.append(
                {
                    "step": step,
                    "title": record.alert.title,
                    "text": record.alert.text,
                    "level": record.alert.level,
                }
            )
    return RunLog("wandb", file, history, alerts, skipped, summary)


# ---------------------------------------------------------------------------------- TensorBoard
def read_tensorboard_run(path: str | Path) -> RunLog:
    """Scalars of TensorBoard event files under ``path`` (needs the ``tensorboard`` package);
    one row per step, merging every tag logged at that step."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as err:  # pragma: no cover - tensorboard is in the test extra
        raise RunReadError("reading TensorBoard runs needs `pip install tensorboard`") from err
    p = Path(path)
    files = sorted(p.rglob("*tfevents*")) if p.is_dir() else [p]
    if not files:
        raise RunReadError(f"{p}: no TensorBoard event files in this folder")
    by_step: dict[float, dict[str, float]] = {}
    for file in files:
        acc = EventAccumulator(str(file), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for event in acc.Scalars(tag):
                row = by_step.setdefault(float(event.step), {"step": float(event.step)})
                row[tag] = float(event.value)
    history = [by_step[s] for s in sorted(by_step)]
    return RunLog("tensorboard", p, history)
