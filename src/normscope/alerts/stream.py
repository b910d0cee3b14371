"""The stream rules: non-finite rows, collapse onto one shared vector, the norm gains' drift, a
stream's scale running away (docs/metrics.md §1.6, docs/alerts.md).

:class:`NonFiniteRule` reads ``dd/rows_rejected``; the other three are
:class:`~normscope.alerts.base.EpisodeRule` s. Each reads run-level ``dd/`` keys, so one episode
is one alert whatever points it moves between; it re-arms after a read that decides "no" (a
read that cannot decide, NaN, neither fires nor re-arms).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from normscope.alerts.base import Alert, EpisodeRule
from normscope.alerts.remedies import REMEDIES

__all__ = [
    "GainDriftRule",
    "NonFiniteRule",
    "RepresentationCollapseRule",
    "ScaleGrowthRule",
    "OBJECTIVES",
    "spread_bounds",
]

#: what a model is trained to do, for :class:`RepresentationCollapseRule`: ``"tokens"`` (a
#: language model) or ``"embedding"`` (embeddings made to agree across views)
OBJECTIVES = ("tokens", "embedding")


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
    tier = "cheap"  # the read tier its keys need (docs/costs.md, "Tiers")
    remedy: str | None = REMEDIES["non_finite_rows"]

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
                remedy=self.remedy,
            )
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"firing": self.firing}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.firing = bool(state.get("firing", False))


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


class RepresentationCollapseRule(EpisodeRule):
    """Complete representation collapse: the final norm's output rows are one shared vector
    (offset share ``dd/final_out_offset_share`` over ``alert_above``, with confidence from the
    rows: the spread share's interval, :func:`spread_bounds`, lies under ``1 - alert_above``),
    what is left varies in no particular direction (centred RankMe ``dd/final_rankme_centred``
    at least ``min_spread_rank`` x the width), and the stream narrows (``dd/sigma_min_ratio_min``
    under ``narrower_below``, unless the stream's input is itself over the line). It fires on
    two such reads in a row, or on one that is the transition from a read clearly under
    ``rise_from``: the transition may land anywhere over ``jump_to`` (a loss of spread in one
    read, 0.07 -> 0.986, is the collapse whatever line it settles under), but needs the
    narrowing read; without the final norm's reads it does not decide. Why each condition, and
    the runs the thresholds were chosen on: docs/alerts.md, "How
    ``RepresentationCollapseRule`` decides".

    Args:
        alert_above: the offset-share line.
        min_spread_rank: the least centred RankMe, as a share of the width ``d``.
        z: the half-width of the spread share's interval, in standard errors.
        min_rows: the fewest final-norm rows a read needs to decide.
        patience: reads in a row.
        rise_from: after a read clearly under this share, one read fires (None: never).
        narrower_below: the narrowing line (None: the profile is not consulted).
        jump_to: a transition from clearly under ``rise_from`` to over this share (with
            confidence), with the rest unstructured and the stream narrowing, fires at once
            (None: only over ``alert_above``).
        objective: what the model is trained to do. ``"tokens"`` (default: a language
            model, causal or masked): every row converging on one vector is also a language
            model's first steps (each position predicts the unigram distribution, then
            recovers), so the conditions above hold it apart. ``"embedding"`` (pooled or
            per-row embeddings made to agree across views: self-supervised, contrastive,
            siamese), where rows converging on one vector is the failure itself: the rule
            fires on the loss of spread alone -- the spread share confidently under
            ``1 - jump_to`` after some earlier read of the run clearly over
            ``1 - rise_from``, or under ``1 - alert_above`` for ``patience`` reads -- with no
            RankMe or profile condition, so it reads the cheap tier only (``tier`` is
            ``"cheap"``: no wait for a spectral read). The model before its first update
            counts as such a read: the first read after residual discovery carries the final
            norm's offset share on the discovery forward (``dd/final_out_offset_share_init``,
            ``dd/final_out_rows_init``, ``dd/final_out_init_step``), taken as the reference
            before that read is judged, so a collapse in the first step fires at the first read.

    Example::

        >>> rule = RepresentationCollapseRule()
        >>> m = {"dd/ln_f/rankme": 2.4, "dd/ln_f/n_rows": 1024.0, "dd/final_rows_per_dim": 16.0,
        ...      "dd/final_out_offset_share": 0.998, "dd/final_rankme_centred": 50.0}
        >>> rule.evaluate(m, 10), [a.rule for a in rule.evaluate(m, 20)]  # the second read
        ([], ['representation_collapse'])
        >>> rule = RepresentationCollapseRule()
        >>> rule.evaluate({**m, "dd/final_out_offset_share": 0.5}, 10)  # clearly low
        []
        >>> narrowing = {**m, "dd/sigma_min_ratio_min": 0.7}
        >>> [a.rule for a in rule.evaluate(narrowing, 20)]  # the transition: one read
        ['representation_collapse']
        >>> rule = RepresentationCollapseRule()
        >>> rule.evaluate({**narrowing, "dd/final_out_offset_share": 0.07}, 2)
        []
        >>> [a.rule for a in rule.evaluate({**narrowing, "dd/final_out_offset_share": 0.986}, 10)]
        ['representation_collapse']
        >>> rule = RepresentationCollapseRule(objective="embedding")  # no RankMe, no profile
        >>> rule.tier
        'cheap'
        >>> first = {"dd/ln_f/rankme": 40.0, "dd/ln_f/n_rows": 1024.0,
        ...          "dd/final_out_offset_share": 0.3}
        >>> rule.evaluate(first, 2)  # clearly spread: the run's own reference
        []
        >>> cheap = {"dd/ln_f/n_rows": 1024.0, "dd/final_out_offset_share": 0.97}
        >>> [a.rule for a in rule.evaluate(cheap, 10)]  # a cheap read: no RankMe needed
        ['representation_collapse']
    """

    name = "representation_collapse"
    tier = "spectral"  # the read tier its keys need (docs/costs.md, "Tiers")
    remedy: str | None = REMEDIES["representation_collapse"]

    def __init__(
        self,
        alert_above: float = 0.99,
        min_spread_rank: float = 0.5,
        z: float = 3.0,
        min_rows: int = 32,
        patience: int = 2,
        rise_from: float | None = 0.8,
        narrower_below: float | None = 1.0,
        jump_to: float | None = 0.95,
        objective: str = "tokens",
    ) -> None:
        super().__init__(patience)
        if objective not in OBJECTIVES:
            raise ValueError(
                f"RepresentationCollapseRule: objective must be one of {OBJECTIVES}, got "
                f"{objective!r}"
            )
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
        if jump_to is not None and not (rise_from is not None and rise_from < jump_to):
            raise ValueError(
                "RepresentationCollapseRule: jump_to must be in (rise_from, 1) or None (and "
                f"needs rise_from), got {jump_to} with rise_from {rise_from}"
            )
        if jump_to is not None and not jump_to < 1:
            raise ValueError(f"RepresentationCollapseRule: jump_to must be < 1, got {jump_to}")
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
        self.jump_to = None if jump_to is None else float(jump_to)
        self.objective = objective
        if objective == "embedding":
            # reads final_out_offset_share and n_rows only: cheap keys (docs/costs.md, "Tiers")
            self.tier = "cheap"
        #: whether the last read with a share was clearly under ``rise_from`` (None: no read yet)
        self.was_low: bool | None = None
        #: ``objective="embedding"``: the step of the run's first read clearly under
        #: ``rise_from`` and its spread share (the reference a loss of spread is read against)
        self.spread_seen: tuple[int, float] | None = None
        #: the reference is the discovery forward's (``dd/final_out_offset_share_init``)
        self.seen_at_init = False
        #: the final norm's path, from the last read that named it (``dd/<path>/rankme``)
        self.final_norm: str | None = None

    def check(self, metrics: Mapping[str, float]) -> tuple[bool | None, Alert | None]:
        key = "dd/final_out_offset_share"
        share = metrics.get(key, math.nan)
        # the final norm: named by its RankMe (a spectral key; the first read always has it),
        # remembered for the cheap reads between spectral ones
        final = _final_norm(metrics) or self.final_norm
        self.final_norm = final
        rows = metrics.get(f"dd/{final}/n_rows", math.nan) if final else math.nan
        per_dim = metrics.get("dd/final_rows_per_dim", math.nan)
        spread_rank = metrics.get("dd/final_rankme_centred", math.nan)
        if self.objective == "embedding" and self.spread_seen is None:
            self._init_reference(metrics)  # before this read is judged: it may be the jump
        if not (math.isfinite(share) and math.isfinite(rows) and rows >= self.min_rows):
            return None, None
        spread = 1.0 - share
        lo, hi = spread_bounds(spread, rows, self.z)
        if self.objective == "embedding":
            return self._embedding(share, spread, lo, hi, rows, final)
        was_low = self.was_low
        # this read, for the next one: clearly under rise_from (the spread's interval above 1 - it)
        self.was_low = self.rise_from is not None and lo > 1.0 - self.rise_from
        limit = 1.0 - self.alert_above
        narrowest = metrics.get("dd/sigma_min_ratio_min", math.nan)
        narrowed = (
            self.narrower_below is not None
            and math.isfinite(narrowest)
            and (narrowest < self.narrower_below or _input_share(metrics) > self.alert_above)
        )
        # a jump: from clearly under rise_from to (confidently) over jump_to in one read, with
        # the stream narrowing behind it (never without the profile: a language model's first
        # steps jump too, and keep the stream's width)
        jump = bool(was_low) and self.jump_to is not None and hi < 1.0 - self.jump_to and narrowed
        if spread >= limit and not jump:
            return False, None
        if hi >= limit and not jump:
            return None, None  # above the line, but the rows cannot tell it from the line
        width = rows / per_dim if per_dim > 0 else math.nan
        if not (math.isfinite(spread_rank) and math.isfinite(width)):
            return None, None
        if spread_rank < self.min_spread_rank * min(width, rows - 1):
            return False, None  # one large shared vector, but the rest is structured
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
        line = self.alert_above if spread < limit else self.jump_to
        how = "" if spread < limit else ", in one read from clearly under " + f"{self.rise_from:g}"
        return True, Alert(
            self.name,
            key,
            self.step,
            float(share),
            float(line),
            f"representation collapse at step {self.step}: the final norm's output rows are one "
            f"shared vector up to {spread:.2%} of their energy (at most {hi:.2%} from "
            f"{rows:.0f} rows; offset share {share:.4f} > {line:g}{how}), and the rest "
            f"varies in no particular direction (centred RankMe {spread_rank:.3g} of "
            f"{width:.0f})",
            point=final,
            remedy=self.remedy,
        )

    def _init_reference(self, metrics: Mapping[str, float]) -> None:
        """Take the final norm's offset share on the discovery forward (the model before its
        first update: ``dd/final_out_offset_share_init``, in the first read after residual
        discovery only) as the reference when it is clearly spread, by the same test as a
        read's."""
        share = metrics.get("dd/final_out_offset_share_init", math.nan)
        rows = metrics.get("dd/final_out_rows_init", math.nan)
        step = metrics.get("dd/final_out_init_step", 0.0)
        if self.rise_from is None or not (math.isfinite(share) and rows >= self.min_rows):
            return
        lo, _ = spread_bounds(1.0 - share, rows, self.z)
        if lo > 1.0 - self.rise_from:
            self.spread_seen = (int(step) if math.isfinite(step) else 0, 1.0 - share)
            self.seen_at_init = True

    def _embedding(
        self, share: float, spread: float, lo: float, hi: float, rows: float, final: str | None
    ) -> tuple[bool | None, Alert | None]:
        """``objective="embedding"``: a loss of spread against the run's own reads, no
        RankMe or profile condition (an embedding made to agree across views has no unigram
        phase to hold apart)."""
        seen = self.spread_seen
        if seen is None and self.rise_from is not None and lo > 1.0 - self.rise_from:
            self.spread_seen = (self.step, spread)  # the reference: clearly spread
        limit = 1.0 - self.alert_above
        jump = seen is not None and self.jump_to is not None and hi < 1.0 - self.jump_to
        if hi < limit and not jump:
            line, how = self.alert_above, ""  # over the line: patience reads in a row
        elif jump:
            assert seen is not None
            line = self.jump_to
            how = f", down from {seen[1]:.1%} at step {seen[0]}"
            if self.seen_at_init:  # the discovery forward's (a resumed run's: its first batch)
                how += " (before the first update)" if seen[0] == 0 else " (the first batch)"
            self.count = max(self.count, self.patience - 1)  # the loss itself: one read
        elif spread >= limit and not (self.jump_to is not None and spread < 1.0 - self.jump_to):
            return False, None
        else:
            return None, None  # near a line, but the rows cannot tell which side
        return True, Alert(
            self.name,
            "dd/final_out_offset_share",
            self.step,
            float(share),
            float(line),
            f"representation collapse at step {self.step}: the final norm's output rows are one "
            f"shared vector up to {spread:.2%} of their energy (at most {hi:.2%} from "
            f"{rows:.0f} rows; offset share {share:.4f} > {line:g}{how}): an embedding "
            "trained to agree has lost its spread",
            point=final,
            remedy=self.remedy,
        )

    def state_dict(self) -> dict[str, Any]:
        seen = None if self.spread_seen is None else list(self.spread_seen)
        return {
            **super().state_dict(),
            "was_low": self.was_low,
            "spread_seen": seen,
            "seen_at_init": self.seen_at_init,
            "final_norm": self.final_norm,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        was_low = state.get("was_low")
        self.was_low = None if was_low is None else bool(was_low)
        seen = state.get("spread_seen")
        self.spread_seen = None if seen is None else (int(seen[0]), float(seen[1]))
        self.seen_at_init = bool(state.get("seen_at_init", False))
        self.final_norm = state.get("final_norm")


class GainDriftRule(EpisodeRule):
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
    tier = "cheap"  # the read tier its keys need (docs/costs.md, "Tiers")
    remedy: str | None = REMEDIES["norm_gain_drift"]

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
            remedy=self.remedy,
        )


def _extreme_layer(metrics: Mapping[str, float], metric: str, summary: str) -> str | None:
    """The layer or point whose per-layer ``metric`` gave the run-level ``summary`` key."""
    target = metrics.get(summary, math.nan)
    for key, value in metrics.items():
        if key.startswith("dd/") and key.endswith(f"/{metric}") and value == target:
            return key[len("dd/") : -len(f"/{metric}")]
    return None


class ScaleGrowthRule(EpisodeRule):
    """A stream's scale running away: some residual point's RMS more than ``max_growth`` x its
    previous read (``dd/rms_growth_max``). The RMS of ``N`` rows is a mean of ``N d`` squares,
    so its sampling error is far below the factor (no interval). The growth is per read, so
    its meaning scales with ``every_n_steps`` (the growth measured on healthy and diverging
    runs: docs/alerts.md, ``ScaleGrowthRule``).

    Example::

        >>> rule = ScaleGrowthRule()
        >>> [a.rule for a in rule.evaluate({"dd/rms_growth_max": 1800.0, "dd/h.1/rms_growth":
        ...                                 1800.0}, 10)]
        ['stream_scale_growth']
        >>> rule.evaluate({"dd/rms_growth_max": 1.1}, 20), rule.firing
        ([], False)
    """

    name = "stream_scale_growth"
    tier = "cheap"  # the read tier its keys need (docs/costs.md, "Tiers")
    remedy: str | None = REMEDIES["stream_scale_growth"]

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
            remedy=self.remedy,
        )
