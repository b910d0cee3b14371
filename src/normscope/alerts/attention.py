"""The attention rule: a pre-softmax attention logit over a line and growing fast
(docs/metrics.md §1.7, docs/alerts.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from normscope.alerts.base import Alert, EpisodeRule
from normscope.alerts.remedies import REMEDIES

__all__ = ["AttentionLogitRule"]


class AttentionLogitRule(EpisodeRule):
    """Attention-logit growth: some attention module's largest pre-softmax logit
    (``dd/<module>/max_logit``, docs/metrics.md §1.7) over ``max_logit`` **and growing** faster
    than ``rate`` per optimiser step, ``ln(v / max(v_ref, base)) / steps`` against that
    module's newest read at least ``min_steps`` earlier, or over ``extreme`` at any read. Its
    softmax rows are then heading for one-hot. ``+inf`` (a half-precision overflow) fires; NaN
    decides nothing (:class:`~normscope.alerts.NonFiniteRule` has it). One alert per episode,
    naming the module, re-armed when no module is over. Why a rate and not a level, and the
    runs behind the defaults: docs/alerts.md, "How ``AttentionLogitRule`` decides".

    Args:
        max_logit: the level a logit must be over.
        rate: the growth per optimiser step it must exceed.
        base: the least reference of the rate (a rise from initialisation is no rate).
        extreme: a level that fires whatever the rate (None: none).
        min_steps: the least span, in steps, between a read and the rate's reference.

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
    tier = "cheap"  # the read tier its keys need (docs/costs.md, "Tiers")
    remedy: str | None = REMEDIES["attention_logit_growth"]

    def __init__(
        self,
        max_logit: float = 45.0,
        rate: float = 0.1,
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
            f"logit{where} is {value:.4g}, {why}: its softmax rows are heading for one-hot",
            point=module or None,
            remedy=self.remedy,
        )

    def state_dict(self) -> dict[str, Any]:
        previous = {k: [list(r) for r in v] for k, v in self.previous.items()}
        return {**super().state_dict(), "previous": previous}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.previous = {
            k: [(float(r[0]), int(r[1])) for r in v] for k, v in state.get("previous", {}).items()
        }
