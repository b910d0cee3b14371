"""The residual-stream rules: a ``sigma_min`` ratio collapse, and its class over the sources."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from normscope.alerts.records import Alert
from normscope.functional.profile import ratio_bounds

__all__ = ["SigmaMinRatioRule", "SourceCollapseRule"]


class SigmaMinRatioRule:
    """Residual collapse: a ``sigma_min`` ratio below ``alert_below - tolerance``, with
    confidence from the rows behind it.

    docs/metrics.md §1.4: with identity skips and no cancellation ``sigma_min`` cannot fall with
    depth, so both the cumulative ratio ``sigma_min(p_k) / sigma_min(p_0)`` and the step ratio
    ``sigma_min(p_k) / sigma_min(p_{k-1})`` stay >= 1. The rule watches both (``watch``): the
    step ratio localises a collapse even where ``p_0`` (an embedding) is so narrow that the
    cumulative ratio stays far above 1 -- in the demo a cancelling MLP branch takes the step at
    its sublayer to 0.39 while every cumulative ratio stays above 3.

    **Rows.** A ratio read from ``N`` rows in ``d`` dimensions is biased low and noisy when
    ``N / d`` is small (Marchenko–Pastur), so a point counts as *below* only when the upper end
    of its interval (``<ratio>_hi``, :func:`normscope.functional.profile.ratio_bounds`) is under
    the threshold. A point under the threshold whose interval reaches above it is *undecided*
    (``undecided[point]``: ``"not_confident"``, or ``"too_few_rows_for_bounds"`` below
    ``N / d = min_rows_per_dim``) and never alerts. Logs without the interval keys (written by
    normscope before 0.3) are judged on the ratio itself.

    **The premise.** Where the no-cancellation margin was measured on the same rows
    (docs/metrics.md §1.4), ``step^2 >= 1 + margin`` holds exactly: a collapse needs the
    premise to fail there. A step under that floor contradicts its own rows (a numerical
    fault, ``"contradicts_margin"``) and is not an alert; an alert says how far the premise
    fails (the margin).

    **A sudden drop.** Small models in early training dip well below 1 with nothing wrong
    (measured: a healthy 4 x 64 demo GPT reads step ratios down to 0.62 between steps 9 and
    40), slowly, over many reads; a cancelling branch drops a point's step ratio from about 1
    to under half in one read. So the floor is low (``alert_below - tolerance`` = 0.6) and a
    second, higher one (``drop_below`` = 0.85, on the interval's top as well) counts only for
    a step ratio under ``drop`` x the same point's step ratio at the previous read (and, once
    below, for as long as it stays under ``drop_below``: one collapse, one alert). The
    operating point of these defaults (0 false alarms on the healthy sweep of
    ``benchmarks/alert_roc.py``, detection delays there) is in docs/alerts.md.

    Args:
        alert_below: the theoretical floor (1.0).
        tolerance: how far below ``alert_below`` a ratio may dip before it counts.
        patience: consecutive reads below the threshold before the alert fires.
        warmup_reads: the first reads of a run, which never alert.
        watch: which ratios to check: ``("ratio", "step")`` (default), or one of them.
        min_rows_per_dim: the least ``N / d`` a read needs to decide (the monitor keeps a
            window open until it has that many rows, at most ``every_n_steps`` steps more).
        drop: a step ratio under this share of the point's previous step ratio is a sudden
            drop, judged against ``drop_below`` instead of the threshold; None: off.
        drop_below: the floor for a sudden drop (``>=`` the threshold).

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

    def __init__(
        self,
        alert_below: float = 1.0,
        tolerance: float = 0.4,
        patience: int = 1,
        warmup_reads: int = 0,
        watch: Sequence[str] = ("ratio", "step"),
        min_rows_per_dim: float = 4.0,
        drop: float | None = 0.6,
        drop_below: float = 0.85,
    ) -> None:
        if patience < 1:
            raise ValueError(f"SigmaMinRatioRule: patience must be >= 1, got {patience}")
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
        self.previous_step: dict[str, float] = {}  # each point's step ratio at the last read
        self.alert_below = alert_below
        self.tolerance = tolerance
        self.patience = patience
        self.warmup_reads = warmup_reads
        self.min_rows_per_dim = float(min_rows_per_dim)
        self.suffixes = tuple(f"/sigma_min_{w}" for w in watch)
        self.sublayers: dict[str, str | None] = {}  # by point; the monitor fills it
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
            elif "rows_per_dim" in values and "n_rows" in values:
                lo, hi = ratio_bounds(value, rows, per_dim)
            else:  # a log without intervals: the ratio itself decides
                lo = hi = value
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
        wanted.add("no_cancellation_margin")
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
        self.undecided = {}
        previous, self.previous_step = self.previous_step, {}
        for point in order:
            values = points[point]
            below, metric, value = self.decide(values)
            sudden = False
            step_value = values.get("sigma_min_step", math.nan)
            if math.isfinite(step_value):
                self.previous_step[point] = step_value
            if not below and self._sudden_drop(values, previous.get(point, math.nan)):
                below, metric, value, sudden = True, "sigma_min_step", step_value, True
            elif not below and self.below.get(point, 0) and self._under_drop_floor(values):
                # below at the last read and still under the drop floor: the same collapse
                # persists (no second alert when its interval top wavers around the floor)
                below, metric, value = True, "sigma_min_step", step_value
            if below is None and value < self.threshold:
                self.undecided[point] = str(metric)
            margin = values.get("no_cancellation_margin", math.nan)
            if below and metric == "sigma_min_step" and math.isfinite(margin):
                # The premise, measured on the same rows: step^2 >= 1 + margin exactly. A step
                # under that floor contradicts its own rows (a numerical fault): no collapse.
                if value < math.sqrt(max(1.0 + margin, 0.0)) * (1 - 1e-9):
                    below = None
                    self.undecided[point] = "contradicts_margin"
            if below and metric == "sigma_min_ratio" and upstream_collapse:
                if not self.step_below(values):
                    below = False  # only downstream of a collapse already counted
            upstream_collapse = upstream_collapse or bool(below)
            self.below[point] = self.below.get(point, 0) + 1 if below else 0
            # Fire once when patience is reached, not on every read after; a collapse that
            # began during the warm-up and still holds fires at the first read after it.
            first_after_warmup = self.reads == self.warmup_reads + 1
            if self.reads <= self.warmup_reads or not (
                self.below[point] == self.patience
                or (first_after_warmup and self.below[point] > self.patience)
            ):
                continue
            sub = self.sublayers.get(point)
            ratio = values.get("sigma_min_ratio", math.nan)
            step_ratio = values.get("sigma_min_step", math.nan)
            hi = values.get(f"{metric}_hi", math.nan)
            per_dim = values.get("rows_per_dim", math.nan)
            rows = (
                f", at most {hi:.3g} from {per_dim:.3g} rows per dimension"
                if math.isfinite(hi) and math.isfinite(per_dim)
                else ""
            )
            if math.isfinite(margin) and margin < 0:
                rows += f"; the no-cancellation premise fails there (margin {margin:.3g})"
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
                    f"{sub or 'block'} sublayer, at step {step}: step ratio {step_ratio:.3g}, "
                    f"cumulative ratio {ratio:.3g}{rows} (threshold {self.threshold:.3g}, "
                    f"{self.patience} read(s))",
                    point=point,
                    sublayer=sub,
                )
            )
        return alerts

    def state_dict(self) -> dict[str, Any]:
        return {
            "reads": self.reads,
            "below": dict(self.below),
            "previous_step": dict(self.previous_step),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reads = int(state.get("reads", 0))
        self.below = {str(k): int(v) for k, v in state.get("below", {}).items()}
        self.previous_step = {str(k): float(v) for k, v in state.get("previous_step", {}).items()}
