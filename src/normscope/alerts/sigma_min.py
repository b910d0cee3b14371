"""The residual-stream collapse rule: a ``sigma_min`` ratio under its floor, with confidence.

:class:`SigmaMinRatioRule` judges the pooled ``dd/<point>/sigma_min_*`` reads;
:func:`below_floor` asks it about one point's read (the per-source classification,
:mod:`normscope.alerts.sources`, decides through it). docs/alerts.md has how it decides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from normscope.alerts.base import Alert
from normscope.alerts.remedies import REMEDIES
from normscope.functional.profile import ratio_bounds

__all__ = ["SigmaMinRatioRule", "below_floor"]


class SigmaMinRatioRule:
    """Residual collapse: a ``sigma_min`` step ratio (docs/metrics.md §1.4) under the floor
    ``alert_below - tolerance`` (0.6) with confidence from the rows behind it (the top of its
    interval, ``<ratio>_hi``, is under the floor), or a sudden drop under ``drop_below``; one
    alert per collapse episode. After each read, ``undecided`` maps the points under the line
    that the rows could not decide to why (``"not_confident"``, ``"too_few_rows_for_bounds"``).
    How it decides, and the measurements behind each default: docs/alerts.md, "How
    ``SigmaMinRatioRule`` decides".

    Args:
        alert_below: the theoretical floor (1.0).
        tolerance: how far below ``alert_below`` a ratio may dip before it counts.
        patience: consecutive reads below the floor before the alert fires.
        warmup_reads: the first reads of a run, which never alert.
        watch: the ratios checked: ``("step",)``, ``("ratio", "step")`` or ``("ratio",)``.
        min_rows_per_dim: the least ``N / d`` a read needs to decide.
        drop: a step ratio under this share of the point's previous one is a sudden drop,
            judged against ``drop_below``; None: off.
        drop_below: the floor for a sudden drop (``>=`` the floor).
        ratio_patience: reads a fall on the cumulative ratio alone must last (``"ratio"``).
        one_per_episode: after an alert, no point alerts until a read has no point below.
        confirm_near_floor: a point undecided under the line at the previous read needs a
            second read below (a ratio hovering at the floor).
        drop_from_first_read: judge a sudden drop against the run's first read too.

    Example::

        >>> rule = SigmaMinRatioRule()
        >>> low = {"dd/h.1/sigma_min_step": 0.5, "dd/h.1/sigma_min_step_hi": 0.56,
        ...        "dd/rows_per_dim": 50.0}
        >>> [a.point for a in rule.evaluate(low, step=10)]
        ['h.1']
        >>> few = {"dd/h.1/sigma_min_step": 0.5, "dd/h.1/sigma_min_step_hi": float("nan"),
        ...        "dd/rows_per_dim": 2.0}
        >>> rule.evaluate(few, step=20), rule.undecided
        ([], {'h.1': 'too_few_rows_for_bounds'})
    """

    name = "sigma_min_collapse"
    remedy: str | None = REMEDIES["sigma_min_collapse"]

    def __init__(
        self,
        alert_below: float = 1.0,
        tolerance: float = 0.4,
        patience: int = 1,
        warmup_reads: int = 0,
        watch: Sequence[str] = ("step",),
        min_rows_per_dim: float = 4.0,
        drop: float | None = 0.6,
        drop_below: float = 0.85,
        ratio_patience: int = 1,
        one_per_episode: bool = True,
        confirm_near_floor: bool = True,
        drop_from_first_read: bool = False,
    ) -> None:
        if patience < 1 or ratio_patience < 1:
            raise ValueError(
                f"SigmaMinRatioRule: patience and ratio_patience must be >= 1, got {patience}, "
                f"{ratio_patience}"
            )
        if tolerance < 0 or warmup_reads < 0:
            raise ValueError("SigmaMinRatioRule: tolerance and warmup_reads must be >= 0")
        if not watch or any(w not in ("ratio", "step") for w in watch):
            raise ValueError(
                f"SigmaMinRatioRule: watch must name 'ratio' and/or 'step', got {watch!r}"
            )
        if not min_rows_per_dim >= 2:
            raise ValueError(
                f"SigmaMinRatioRule: min_rows_per_dim must be >= 2 (the profile reads NaN "
                f"below 2 d rows), got {min_rows_per_dim}"
            )
        if drop is not None and not 0 < drop < 1:
            raise ValueError(f"SigmaMinRatioRule: drop must be in (0, 1) or None, got {drop}")
        self.drop = drop
        self.drop_below = float(drop_below)
        self.ratio_patience = int(ratio_patience)
        self.confirm_near_floor = bool(confirm_near_floor)
        self.drop_from_first_read = bool(drop_from_first_read)
        self.onset_need: dict[str, int] = {}  # reads below each point's onset needs to fire
        self.one_per_episode = bool(one_per_episode)
        self.in_episode = False  # an alert fired and some point has stayed below since
        self.previous_step: dict[str, float] = {}  # each point's step ratio at the last read
        self.alert_below = alert_below
        self.tolerance = tolerance
        self.patience = patience
        self.warmup_reads = warmup_reads
        self.min_rows_per_dim = float(min_rows_per_dim)
        self.suffixes = tuple(f"/sigma_min_{w}" for w in watch)
        self.sublayers: dict[str, str | None] = {}  # by point; the monitor fills it
        self.modules: dict[str, str] = {}  # by point: the sublayer module before it (alerts)
        self.reads = 0
        self.below: dict[str, int] = {}
        self.undecided: dict[str, str] = {}  # the last read's points under the line, undecided

    @property
    def threshold(self) -> float:
        return self.alert_below - self.tolerance

    def decide(
        self,
        values: Mapping[str, float],
        *,
        threshold: float | None = None,
        suffixes: Sequence[str] | None = None,
    ) -> tuple[bool | None, str | None, float]:
        """One point's read: ``(below, metric, value)``, against ``threshold`` (default: the
        rule's) on the ratios ``suffixes`` names (default: those it watches).

        ``values`` holds the point's metrics by name (``sigma_min_ratio``, ``sigma_min_step``,
        their ``_lo``/``_hi`` and ``rows_per_dim``, when logged; a per-source read gives
        ``n_rows`` and ``rows_per_dim`` and the interval is computed here). ``below`` is True
        when a watched ratio's interval lies under the threshold, False when every finite
        watched ratio is at or above it (``sigma_min`` is read low, not high) with rows enough
        for an interval, None when the rows cannot decide (then
        ``metric`` is the reason: ``"too_few_rows_for_bounds"``, ``"not_confident"``, or
        ``"no_finite_ratio"``). Otherwise ``metric`` names the smallest watched ratio below
        (or the smallest one), ``value`` its value.
        """
        per_dim = values.get("rows_per_dim", math.nan)
        rows = values.get("n_rows", math.nan)
        thr = self.threshold if threshold is None else threshold
        reads: list[tuple[float, str, float, float]] = []  # value, metric, lo, hi
        for suffix in self.suffixes if suffixes is None else suffixes:
            metric = suffix[1:]
            value = values.get(metric, math.nan)
            if not math.isfinite(value):
                continue
            if f"{metric}_hi" in values:
                lo, hi = values.get(f"{metric}_lo", math.nan), values[f"{metric}_hi"]
            else:  # a per-source read: the interval from its rows (NaN without them)
                lo, hi = ratio_bounds(value, rows, per_dim)
            if math.isfinite(per_dim) and per_dim < self.min_rows_per_dim:
                lo = hi = math.nan
            reads.append((float(value), metric, lo, hi))
        if not reads:
            return None, "no_finite_ratio", math.nan
        below = [r for r in reads if r[3] < thr]
        if below:
            value, metric, _, _ = min(below)
            return True, metric, value
        if any(math.isnan(r[3]) for r in reads):
            return None, "too_few_rows_for_bounds", min(reads)[0]
        if all(r[0] >= thr for r in reads):
            # sigma_min is read low, not high: a ratio at or above the line is no collapse
            value, metric, _, _ = min(reads)
            return False, metric, value
        return None, "not_confident", min(reads)[0]

    @property
    def _step_suffixes(self) -> tuple[str, ...]:
        return tuple(s for s in self.suffixes if s == "/sigma_min_step")

    def _sudden_drop(self, values: Mapping[str, float], previous: float) -> bool:
        """The step ratio fell under ``drop`` x its previous read and its interval's top is
        under ``drop_below`` (rows enough for an interval; a log without one: the ratio)."""
        step_value = values.get("sigma_min_step", math.nan)
        if not (math.isfinite(step_value) and math.isfinite(previous)):
            return False
        if not self.drop_from_first_read and self.reads <= 2:
            return False  # the previous read is the run's first, taken at initialisation
        return step_value < (self.drop or 0.0) * previous and self._under_drop_floor(values)

    def _under_drop_floor(self, values: Mapping[str, float]) -> bool:
        """The step ratio's interval top is under ``drop_below`` (never with ``drop=None``)."""
        if self.drop is None:
            return False
        floor = min(self.drop_below, self.alert_below)
        return bool(self.decide(values, threshold=floor, suffixes=self._step_suffixes)[0])

    def step_below(self, values: Mapping[str, float]) -> bool:
        """Is the point's own step ratio below the threshold, with confidence? A point below
        on its cumulative ratio alone, downstream of a collapse, is that collapse's echo."""
        return bool(self.decide(values, suffixes=self._step_suffixes)[0])

    def _points(self, metrics: Mapping[str, float]) -> dict[str, dict[str, float]]:
        """The pooled ``dd/<point>/<metric>`` keys by point (profile points only)."""
        names = {s[1:] for s in self.suffixes}
        wanted = {"sigma_min_ratio", "sigma_min_step", "rows_per_dim", "n_rows"}
        wanted |= {f"{n}_{e}" for n in ("sigma_min_ratio", "sigma_min_step") for e in ("lo", "hi")}
        points: dict[str, dict[str, float]] = {}
        for key, value in metrics.items():
            if not key.startswith("dd/"):
                continue
            point, _, metric = key[len("dd/") :].rpartition("/")
            if point and metric in wanted:
                points.setdefault(point, {})[metric] = float(value)
        per_dim = metrics.get("dd/rows_per_dim")
        if per_dim is not None:  # one N/d per read: the points fold the same rows
            for values in points.values():
                values.setdefault("rows_per_dim", float(per_dim))
        return {p: v for p, v in points.items() if names & v.keys()}

    def evaluate(self, metrics: Mapping[str, float], step: int) -> list[Alert]:
        self.reads += 1
        points = self._points(metrics)
        # In depth order, a point below only on the cumulative ratio whose own step is fine is a
        # consequence of a collapse upstream, already reported there: count it once.
        order = [p for p in self.sublayers if p in points] + [
            p for p in points if p not in self.sublayers
        ]
        upstream_collapse = False
        alerts: list[Alert] = []
        near, self.undecided = self.undecided, {}
        previous, self.previous_step = self.previous_step, {}
        any_below = False
        for point in order:
            values = points[point]
            below, metric, value = self.decide(values)
            sudden = False
            step_value = values.get("sigma_min_step", math.nan)
            if math.isfinite(step_value):
                self.previous_step[point] = step_value
            if not below and self._sudden_drop(values, previous.get(point, math.nan)):
                below, metric, value, sudden = True, "sigma_min_step", step_value, True
            elif (
                not below
                and self.below.get(point, 0) >= self.onset_need.get(point, self.patience)
                and self._under_drop_floor(values)
            ):
                # below at the last read and still under the drop floor: the same collapse
                # persists (no second alert when its interval top wavers around the floor)
                below, metric, value = True, "sigma_min_step", step_value
            if below is None and value < self.threshold:
                self.undecided[point] = str(metric)
            if below and metric == "sigma_min_ratio" and upstream_collapse:
                if not self.step_below(values):
                    below = False  # only downstream of a collapse already counted
            upstream_collapse = upstream_collapse or bool(below)
            any_below = any_below or bool(below)
            self.below[point] = self.below.get(point, 0) + 1 if below else 0
            # A fall on the cumulative ratio alone (no step of its own under the line, no
            # sudden drop) waits ratio_patience reads: spread over many sublayers, it is what
            # healthy early training does for a read or two (docs/alerts.md).
            need = self.patience
            if below and metric == "sigma_min_ratio" and not sudden:
                need = max(self.patience, self.ratio_patience)
            if below and not sudden and self.confirm_near_floor and point in near:
                # under the line but undecided at the last read: hovering at the floor, one
                # read in many dips under it by chance; a second read below confirms
                need = max(need, 2)
            if below and self.below[point] == 1:
                self.onset_need[point] = need  # decided at the onset, kept while it holds
            need = self.onset_need.get(point, need) if below else need
            # Fire once when patience is reached, not on every read after; a collapse that
            # began during the warm-up and still holds fires at the first read after it.
            first_after_warmup = self.reads == self.warmup_reads + 1
            if self.reads <= self.warmup_reads or not (
                self.below[point] == need or (first_after_warmup and self.below[point] > need)
            ):
                continue
            if self.one_per_episode and (self.in_episode or alerts):
                continue  # the episode's alert is out: not one per point it moves through
            sub = self.sublayers.get(point)
            module = f" ({self.modules[point]})" if point in self.modules else ""
            ratio = values.get("sigma_min_ratio", math.nan)
            step_ratio = values.get("sigma_min_step", math.nan)
            hi = values.get(f"{metric}_hi", math.nan)
            per_dim = values.get("rows_per_dim", math.nan)
            rows = (
                f", at most {hi:.3g} from {per_dim:.3g} rows per dimension"
                if math.isfinite(hi) and math.isfinite(per_dim)
                else ""
            )
            if sudden:
                rows += f"; a sudden drop from {previous[point]:.3g} at the previous read"
            alerts.append(
                Alert(
                    self.name,
                    f"dd/{point}/{metric}",
                    step,
                    value,
                    self.threshold,
                    f"residual stream sigma_min collapsed at {point}, after the "
                    f"{sub or 'block'} sublayer{module}, at step {step}: "
                    f"step ratio {step_ratio:.3g}, "
                    f"cumulative ratio {ratio:.3g}{rows} (threshold {self.threshold:.3g}, "
                    f"{self.patience} read(s))",
                    point=point,
                    sublayer=sub,
                    remedy=self.remedy,
                )
            )
        # the episode ends at the first read with no point below (one that cannot decide ends
        # it too: a collapse that holds reads below again, and fires again)
        self.in_episode = bool(alerts or self.in_episode) and any_below
        return alerts

    def state_dict(self) -> dict[str, Any]:
        return {
            "reads": self.reads,
            "below": dict(self.below),
            "previous_step": dict(self.previous_step),
            "in_episode": self.in_episode,
            "onset_need": dict(self.onset_need),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.in_episode = bool(state.get("in_episode", False))
        self.onset_need = {str(k): int(v) for k, v in state.get("onset_need", {}).items()}
        self.reads = int(state.get("reads", 0))
        self.below = {str(k): int(v) for k, v in state.get("below", {}).items()}
        self.previous_step = {str(k): float(v) for k, v in state.get("previous_step", {}).items()}


def below_floor(values: Mapping[str, float], rule: Any = None) -> bool | None:
    """Is this read of one point below the floor, with rows enough to decide?

    ``values``: the point's metrics (``sigma_min_ratio``, ``sigma_min_step``, optionally
    ``n_rows``, ``rows_per_dim`` and the ``_lo``/``_hi`` intervals). ``rule``: a
    :class:`~normscope.alerts.SigmaMinRatioRule` (default ``SigmaMinRatioRule()``), whose
    :meth:`~normscope.alerts.SigmaMinRatioRule.decide` answers: True when a watched ratio's
    interval lies under the threshold, False when every one is at or above it with rows
    enough for an interval, None when the rows cannot decide (no row, too few rows for an
    interval, a ratio under the threshold whose interval reaches above it, no finite ratio).
    The pooled rule and the per-source classification decide alike.
    """
    rule = rule if rule is not None else SigmaMinRatioRule()
    rows = values.get("n_rows", math.inf)
    if not (rows > 0):  # NaN or no row
        return None
    return rule.decide(values)[0]
