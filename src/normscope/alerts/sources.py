"""Per-source ``sigma_min`` reads and the classification of a collapse over the sources.

With ``sources=`` the tracker reads one depth profile per source beside the pooled one,
logged as ``dd.<source>/<point>/<metric>`` (:func:`source_reads`). A point is a *collapse
onset* in one read (pooled or one source) when it is below the floor (:func:`below_floor`) and
is not merely downstream of a collapse already counted in that read (the rule of
:class:`~normscope.alerts.SigmaMinRatioRule`). Every onset is classified over the sources
*that decide there* (rows enough, finite reads):

* ``intrinsic`` (code 1): two or more sources decide and every one is below the floor;
* ``distribution-dependent`` (code 2): some deciding source is below, another is not;
* ``undetermined`` (code 3): below somewhere, but fewer than two sources decide, or the
  pooled read alone is below.

The classification is computed from the flat metrics alone (:func:`classify_collapses`,
:func:`collapse_keys` for the logged ``dd/collapse_class`` ... keys), so an alert rule
(:class:`SourceCollapseRule`) and a saved run reach the same verdict as the tracker. The keys
and the options: docs/sources.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from normscope.alerts.base import Alert
from normscope.alerts.remedies import REMEDIES
from normscope.alerts.sigma_min import SigmaMinRatioRule, below_floor

__all__ = [
    "CLASS_CODE",
    "Collapse",
    "SourceCollapseRule",
    "classify_collapses",
    "collapse_keys",
    "describe",
    "source_reads",
]

CLASS_CODE = {"intrinsic": 1.0, "distribution-dependent": 2.0, "undetermined": 3.0}
_WATCHED = ("sigma_min_ratio", "sigma_min_step")
_KEPT = {*_WATCHED, "depth", "n_rows", "rows_per_dim"}
_KEPT |= {f"{m}_{end}" for m in _WATCHED for end in ("lo", "hi")}


@dataclass(frozen=True)
class Collapse:
    """One classified point: its class, where, and how each source read there."""

    point: str
    depth: int
    kind: str  # "intrinsic" | "distribution-dependent" | "undetermined"
    below: tuple[str, ...]  # deciding sources below the floor
    above: tuple[str, ...]  # deciding sources not below
    undecided: tuple[str, ...]  # sources without rows enough (or a finite read) there
    pooled_below: bool | None
    values: dict[str, float] = field(default_factory=dict)  # smallest watched ratio by source

    @property
    def code(self) -> float:
        return CLASS_CODE[self.kind]


def _reads(metrics: Mapping[str, float]) -> dict[str | None, dict[str, dict[str, float]]]:
    """``{None: pooled, source: ...}``, each ``{point: {metric: value}}``, profile points only."""
    out: dict[str | None, dict[str, dict[str, float]]] = {}
    for key, value in metrics.items():
        head, sep, rest = key.partition("/")
        if not sep or "/" not in rest:
            continue
        point, metric = rest.rsplit("/", 1)
        if metric not in _KEPT:
            continue
        if head == "dd":
            source = None
        elif head.startswith("dd."):
            source = head[len("dd.") :]
        else:
            continue
        out.setdefault(source, {}).setdefault(point, {})[metric] = float(value)
    # norm layers have no sigma_min_step: keep the profile's points
    for source, read in out.items():
        head = "dd" if source is None else f"dd.{source}"
        per_dim = metrics.get(f"{head}/rows_per_dim")
        if per_dim is not None:  # one N/d per read (the points fold the same rows)
            for values in read.values():
                values.setdefault("rows_per_dim", float(per_dim))
        for point in [p for p, m in read.items() if "sigma_min_step" not in m]:
            del read[point]
    return out


def _onsets(read: dict[str, dict[str, float]], order: list[str], rule: Any) -> set[str]:
    onsets: set[str] = set()
    upstream = False
    rule = rule if rule is not None else SigmaMinRatioRule()
    for point in order:
        values = read.get(point)
        if values is None:
            continue
        below = below_floor(values, rule)
        if not below:
            continue
        # as SigmaMinRatioRule: below on the cumulative ratio only, its own step fine, after a
        # collapse upstream in this read: a consequence, counted there
        if not upstream or rule.step_below(values):
            onsets.add(point)
        upstream = True
    return onsets


def classify_collapses(metrics: Mapping[str, float], rule: Any = None) -> list[Collapse]:
    """Every classified point, shallowest first, from a flat metric dict (the classes: module
    docstring). Empty without per-source keys."""
    reads = _reads(metrics)
    sources = sorted(s for s in reads if s is not None)
    if not sources:
        return []
    depth: dict[str, float] = {}
    for read in reads.values():
        for point, m in read.items():
            if math.isfinite(m.get("depth", math.nan)):
                depth.setdefault(point, m["depth"])
    order = sorted(depth, key=lambda p: depth[p])
    onsets: set[str] = set()
    for read in reads.values():
        onsets |= _onsets(read, order, rule)
    out: list[Collapse] = []
    for point in order:
        if point not in onsets:
            continue
        below, above, undecided, values = [], [], [], {}
        for s in sources:
            m = reads[s].get(point, {})
            verdict = below_floor(m, rule) if m else None
            if verdict is None:
                undecided.append(s)
                continue
            values[s] = min(v for k in _WATCHED if math.isfinite(v := m.get(k, math.nan)))
            (below if verdict else above).append(s)
        pooled = reads.get(None, {}).get(point)
        pooled_below = below_floor(pooled, rule) if pooled else None
        if below and above:
            kind = "distribution-dependent"
        elif len(below) >= 2 and not above:
            kind = "intrinsic"
        else:
            kind = "undetermined"
        out.append(
            Collapse(
                point,
                int(depth[point]),
                kind,
                tuple(below),
                tuple(above),
                tuple(undecided),
                pooled_below,
                values,
            )
        )
    return out


def collapse_keys(metrics: Mapping[str, float], rule: Any = None) -> dict[str, float]:
    """The classification keys of a metric dict that holds per-source keys (else ``{}``)."""
    reads = _reads(metrics)
    sources = [s for s in reads if s is not None]
    if not sources:
        return {}
    collapses = classify_collapses(metrics, rule)
    out = {f"dd/{c.point}/collapse_class": c.code for c in collapses}
    first = collapses[0] if collapses else None
    out["dd/collapse_class"] = first.code if first else 0.0
    out["dd/collapse_depth"] = float(first.depth) if first else math.nan
    read = 0
    for s in sources:
        p0 = [m for m in reads[s].values() if m.get("depth") == 0.0]
        if p0 and math.isfinite(metrics.get(f"dd.{s}/n_rows", math.nan)):
            if math.isfinite(p0[0].get("sigma_min_ratio", math.nan)):
                read += 1
    out["dd/sources_read"] = float(read)
    order = sorted({p for r in reads.values() for p in r}, key=lambda p: _depth_of(reads, p))
    out["dd/sources_collapsed"] = float(sum(1 for s in sources if _onsets(reads[s], order, rule)))
    return out


def _depth_of(reads: Mapping[Any, Mapping[str, Mapping[str, float]]], point: str) -> float:
    for read in reads.values():
        d = read.get(point, {}).get("depth", math.nan)
        if math.isfinite(d):
            return d
    return math.inf


def source_reads(profiles: Mapping[str, Any], key_path: Any = str) -> dict[str, float]:
    """Flat ``dd.<source>/...`` keys of per-source :class:`~normscope.SigmaMinProfile` s."""
    out: dict[str, float] = {}
    for source, profile in profiles.items():
        head = f"dd.{source}"
        for p in profile.points:
            name = key_path(p.name)
            out[f"{head}/{name}/sigma_min"] = p.sigma_min
            out[f"{head}/{name}/sigma_min_ratio"] = p.sigma_min_ratio
            out[f"{head}/{name}/sigma_min_step"] = p.sigma_min_step
            out[f"{head}/{name}/depth"] = float(p.depth)
            out[f"{head}/{name}/n_rows"] = float(p.n_rows)
        out[f"{head}/sigma_min_ratio_min"] = profile.sigma_min_ratio_min
        out[f"{head}/rows_per_dim"] = profile.points[0].rows_per_dim if profile.points else math.nan
        out[f"{head}/n_rows"] = float(profile.points[0].n_rows) if profile.points else 0.0
    return out


def describe(collapse: Collapse, sublayer: str | None = None) -> str:
    """One line naming the collapse: where, which class, which sources."""
    after = f" after {sublayer}" if sublayer else ""
    quoted = ", ".join(repr(s) for s in collapse.below)
    vals = ", ".join(f"{s} {collapse.values[s]:.3g}" for s in (*collapse.below, *collapse.above))
    if collapse.kind == "distribution-dependent":
        only = "source" if len(collapse.below) == 1 else "sources"
        healthy = ", ".join(repr(s) for s in collapse.above)
        pooled = {True: "below", False: "not below", None: "unread"}[collapse.pooled_below]
        return (
            f"collapse at {collapse.point}{after} under {only} {quoted} only "
            f"(distribution-dependent: healthy in {healthy}; pooled read {pooled}; "
            f"smallest ratio by source: {vals})"
        )
    if collapse.kind == "intrinsic":
        return (
            f"collapse at {collapse.point}{after} in every source ({quoted}): intrinsic "
            f"(smallest ratio by source: {vals})"
        )
    why = (
        f"sources without rows enough there: {', '.join(collapse.undecided)}"
        if collapse.undecided
        else "no source below alone"
    )
    return f"collapse at {collapse.point}{after}: undetermined ({why})"


class SourceCollapseRule:
    """A collapse classified over the sources (``sources=``; :mod:`normscope.alerts.sources`):
    fires once per point and class when a point is classified ``intrinsic`` or
    ``distribution-dependent`` (``undetermined`` too with ``undetermined=True``), naming the
    sources below, e.g. ``collapse at h.3 after mlp under source 'code' only``. Fires again
    only after that point has left the class for a read.

    Args:
        sigma_rule: the :class:`SigmaMinRatioRule` whose ``threshold`` is the floor (default
            ``SigmaMinRatioRule()``); the monitor passes its own.
        undetermined: also alert on points below somewhere that no two sources decide.
    """

    name = "source_collapse"
    remedy: str | None = REMEDIES["source_collapse"]

    def __init__(self, sigma_rule: SigmaMinRatioRule | None = None, undetermined: bool = False):
        self.sigma_rule = sigma_rule if sigma_rule is not None else SigmaMinRatioRule()
        self.undetermined = undetermined
        self.sublayers: dict[str, str | None] = {}  # by point; the monitor fills it
        self.firing: set[str] = set()  # "point|kind"

    @property
    def threshold(self) -> float:
        return self.sigma_rule.threshold

    def evaluate(self, metrics: Mapping[str, float], step: int) -> list[Alert]:
        collapses = classify_collapses(metrics, self.sigma_rule)
        now = {f"{c.point}|{c.kind}" for c in collapses}
        self.firing &= now
        alerts = []
        for c in collapses:
            tag = f"{c.point}|{c.kind}"
            if tag in self.firing or (c.kind == "undetermined" and not self.undetermined):
                continue
            self.firing.add(tag)
            sub = self.sublayers.get(c.point)
            value = min(c.values[s] for s in c.below) if c.below else math.nan
            alerts.append(
                Alert(
                    self.name,
                    f"dd/{c.point}/collapse_class",
                    step,
                    float(value),
                    self.threshold,
                    f"residual stream sigma_min: {describe(c, sub)} at step {step} "
                    f"(threshold {self.threshold:.3g})",
                    point=c.point,
                    sublayer=sub,
                    remedy=self.remedy,
                )
            )
        return alerts

    def state_dict(self) -> dict[str, Any]:
        return {"firing": sorted(self.firing)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.firing = set(state.get("firing", []))
