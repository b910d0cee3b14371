"""Where a read goes: the loggers (:class:`Target`), which per-layer keys they get
(``log_per_layer``), and what a W&B run gets beyond scalars.

**log_per_layer**.
A 32-layer model logs about 1,200 ``dd/<layer>/<metric>`` keys a read. ``log_per_layer`` keeps
every run-level key (``dd/<metric>``, ``sm/<metric>``) and, of the per-layer keys, all of them
(``"all"``, the default), none (``"none"``), or those of the ``k`` worst layers (an int): for
each ranking below, the ``k`` layers that rank worst, their union kept whole (every metric of a
kept layer). The alert rules and ``trainer.callback_metrics`` always see every key: a layer
left out of the log still alerts.

Rankings (worst first; NaN never ranks):

* ``dd``: smallest ``sigma_min_step`` (the sublayer that shrank the stream most), largest
  ``kernel_residual`` (a LayerNorm's kernel lost), largest ``deepening``;
* ``sm``: largest ``max_leverage``, largest ``sign_churn``, largest ``asymmetry_ratio``.
"""

from __future__ import annotations

import math
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any

from normscope.families.names import named_key, parse_family

__all__ = ["SUMMARIES", "Target", "check_log_per_layer", "select_layers"]

LogPerLayer = str | int

# family -> [(metric, worst is larger)]
RANKINGS: dict[str, tuple[tuple[str, bool], ...]] = {
    "dd": (("sigma_min_step", False), ("kernel_residual", True), ("deepening", True)),
    "sm": (("max_leverage", True), ("sign_churn", True), ("asymmetry_ratio", True)),
}


def check_log_per_layer(value: object, owner: str) -> LogPerLayer:
    """``value`` if it is ``"all"``, ``"none"`` or an int >= 0, else ``ValueError`` naming
    ``owner``."""
    if value in ("all", "none"):
        return value  # type: ignore[return-value]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError(
        f"{owner}: log_per_layer must be 'all', 'none' or an int >= 0 (the worst layers kept), "
        f"got {value!r}"
    )


def select_layers(metrics: Mapping[str, float], keep: LogPerLayer) -> dict[str, float]:
    """The keys of ``metrics`` to log under ``log_per_layer=keep``.

    Example::

        >>> m = {"dd/sigma_min_ratio_min": 0.5, "dd/a/sigma_min_step": 0.9,
        ...      "dd/b/sigma_min_step": 0.4, "dd/b/depth": 1.0}
        >>> sorted(select_layers(m, 1))
        ['dd/b/depth', 'dd/b/sigma_min_step', 'dd/sigma_min_ratio_min']
        >>> sorted(select_layers(m, "none"))
        ['dd/sigma_min_ratio_min']
    """
    if keep == "all":
        return dict(metrics)
    by_layer: dict[tuple[str, str], dict[str, float]] = {}
    out: dict[str, float] = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) < 3:
            out[key] = value  # run-level (and anything not <family>/<layer>/<metric>)
            continue
        family, layer = parts[0], "/".join(parts[1:-1])
        by_layer.setdefault((family, layer), {})[parts[-1]] = value
    if keep == "none" or keep == 0:
        return out
    kept: set[tuple[str, str]] = set()
    for family in {f for f, _ in by_layer}:
        layers = {name: m for (f, name), m in by_layer.items() if f == family}
        # a per-source family (dd.<source>) ranks as its own family (dd)
        for metric, larger_is_worse in RANKINGS.get(family.split(".", 1)[0], ()):
            ranked = [
                (v, name)
                for name, m in layers.items()
                if (v := m.get(metric)) is not None and math.isfinite(v)
            ]
            ranked.sort(key=lambda t: -t[0] if larger_is_worse else t[0])
            kept.update((family, name) for _, name in ranked[: int(keep)])
    for family, layer in kept:
        for metric, value in by_layer[(family, layer)].items():
            out[f"{family}/{layer}/{metric}"] = value
    return out


# ------------------------------------------------------------------------------ targets
class Target:
    """One place reads are logged to: a logger object (anything with ``log_metrics(metrics,
    step)``: Lightning's and Fabric's loggers) or a callable (``wandb.log``, ``print``...:
    called ``fn(metrics, step=step)`` when it takes a ``step``, else ``fn(metrics)``).

    ``wandb_run`` (a zero-argument callable returning a W&B run, or None) gives the run the
    W&B extras go to; ``step_key`` the run's step metric (Lightning's ``trainer/global_step``).
    Without them a ``wandb.log`` / ``run.log`` callable is recognised by itself.

    Example::

        >>> seen = []
        >>> Target(lambda m, step: seen.append((step, m))).log({"dd/x": 1.0}, 3)
        >>> seen
        [(3, {'dd/x': 1.0})]
    """

    def __init__(
        self,
        sink: Any,
        *,
        wandb_run: Callable[[], Any] | None = None,
        step_key: str | None = None,
    ) -> None:
        self.sink = sink
        if hasattr(sink, "log_metrics"):
            self._log: Callable[[dict[str, float], int], None] = sink.log_metrics
        elif callable(sink):
            try:
                params = inspect.signature(sink).parameters
            except (TypeError, ValueError):  # builtins without a signature
                params = {}
            takes_step = "step" in params or any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
            )
            self._log = (
                (lambda m, step: sink(dict(m), step=step))
                if takes_step
                else (lambda m, step: sink(dict(m)))
            )
        else:
            raise TypeError(f"normscope: log must be a callable or a logger, got {sink!r}")
        self.step_key = step_key
        self._wandb_run = wandb_run if wandb_run is not None else _wandb_callable_run(sink)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._log(metrics, step)

    def wandb_run(self) -> Any:
        """The W&B run this target writes to, or None."""
        return self._wandb_run() if self._wandb_run is not None else None


def _wandb_callable_run(fn: Any) -> Callable[[], Any] | None:
    """A plain-loop ``log=wandb.log`` or ``log=run.log``: its run (W&B's own step)."""
    if not (getattr(fn, "__module__", "") or "").startswith("wandb"):
        return None
    owner = getattr(fn, "__self__", None)
    if owner is not None and hasattr(owner, "define_metric"):
        return lambda: owner
    return lambda: getattr(sys.modules.get("wandb"), "run", None)


def as_targets(log: Any) -> list[Target]:
    """``log=`` of a monitor: None, a target, a logger or a callable, or a list of them."""
    if log is None:
        return []
    items = list(log) if isinstance(log, (list, tuple)) else [log]
    return [x if isinstance(x, Target) else Target(x) for x in items]


# ------------------------------------------------------------------------------ W&B
#: run-level key -> W&B summary ("min" / "max" over the run): the run table and the sweep view
#: show the worst read of the run, not the last one
SUMMARIES: dict[str, str] = {
    "dd/sigma_min_ratio_min": "min",
    "dd/sigma_min_step_min": "min",
    "dd/gamma_alignment_min": "min",
    "dd/rows_rejected": "max",
    "dd/reads_disabled": "max",
    "sm/max_leverage_max": "max",
    "sm/sign_churn_mean": "max",
    "sm/reads_disabled": "max",
}

# (run id, family head) pairs whose summaries are defined: per family, so that a second monitor
# in the same run (an sm next to a dd, a dd[fast] next to a dd) gets its own
_DEFINED: set[tuple[str, str]] = set()
# (run id, family head) -> that family's smallest worst-point value so far
_RUN_MIN: dict[tuple[str, str], float] = {}


def _run_key(run: Any) -> str:
    return str(getattr(run, "id", None) or id(run))


def define_summaries(run: Any, step_key: str | None, metrics: Mapping[str, float]) -> None:
    """``define_metric`` for the run-level keys of :data:`SUMMARIES`, once per W&B run and
    family (``dd``, ``sm``, a named monitor's ``dd[fast]``)."""
    key = _run_key(run)
    for head in sorted({k.split("/", 1)[0] for k in metrics}):
        family, name, source = parse_family(head)
        if family is None or source is not None or (key, head) in _DEFINED:
            continue
        for metric, summary in SUMMARIES.items():
            if metric.split("/", 1)[0] != family:
                continue
            metric = named_key(metric, name)
            if step_key is None:
                run.define_metric(metric, summary=summary)
            else:
                run.define_metric(metric, step_metric=step_key, summary=summary)
        _DEFINED.add((key, head))


def note_worst(run: Any, head: str, worst: tuple[float, str] | None, step: int) -> None:
    """``<head>/worst_point`` and ``<head>/worst_point_step`` in the run's summary when this
    read's ``worst = (value, point)`` is the run's smallest so far."""
    if worst is None:
        return
    key = (_run_key(run), head)
    if worst[0] < _RUN_MIN.get(key, float("inf")):
        _RUN_MIN[key] = worst[0]
        run.summary[f"{head}/worst_point"] = worst[1]
        run.summary[f"{head}/worst_point_step"] = step
