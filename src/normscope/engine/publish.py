"""Where a read goes: the loggers (:class:`Target`), which per-layer keys they get
(``log_per_layer``), what a W&B run gets beyond scalars, and :class:`Publisher`, which sends one
read to all of them, runs the rules and hands what fired to the sinks.

**log_per_layer.** A 32-layer model logs about 1,200 ``dd/<layer>/<metric>`` keys a read.
``log_per_layer`` keeps every run-level key (``dd/<metric>``, ``sm/<metric>``) and, of the
per-layer keys, all of them (``"all"``, the default), none (``"none"``), or those of the ``k``
worst layers (an int): for each ranking in :data:`RANKINGS`, the ``k`` layers that rank worst,
their union kept whole (every metric of a kept layer). The alert rules and
``trainer.callback_metrics`` always see every key: a layer left out of the log still alerts.

Rankings (worst first; NaN never ranks): ``dd``: smallest ``sigma_min_step``, largest
``kernel_residual``, largest ``delta_gamma``, largest ``max_logit``; ``sm``: largest
``max_leverage``, largest ``sign_churn``, largest ``asymmetry_ratio``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from normscope._common import disabled_message, logger
from normscope._distributed import rank_zero
from normscope.alerts.paging import Pager
from normscope.engine.keys import named_key, named_metrics, parse_family

__all__ = [
    "LogPerLayer",
    "Publisher",
    "RANKINGS",
    "SUMMARIES",
    "Target",
    "as_targets",
    "check_log_per_layer",
    "define_summaries",
    "note_worst",
    "select_layers",
]


LogPerLayer = str | int

# family -> [(metric, worst is larger)]
RANKINGS: dict[str, tuple[tuple[str, bool], ...]] = {
    "dd": (
        ("sigma_min_step", False),
        ("kernel_residual", True),
        ("delta_gamma", True),
        ("max_logit", True),
    ),
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


# ------------------------------------------------------------------------------ publisher
class Publisher:
    """One monitor's publishing: every read to each :class:`Target` (``log_per_layer`` applied,
    ``name`` in the keys), the rules evaluated on the canonical keys, what fired sorted by the
    ``pager`` (:class:`~normscope.alerts.paging.Pager`: one event, one page) and its pages sent
    to the sinks (rank zero), and the W&B extras. A target, rule or sink that raises is warned
    about once (``warn_once(key, message)``) and left out from then on; the others go on.

    Example::

        >>> seen = []
        >>> pub = Publisher(label="DeadDirectionMonitor", name=None, log_per_layer="all",
        ...                 sinks=[], targets=as_targets(lambda m, step: seen.append(step)),
        ...                 warn_once=print)
        >>> fired, logged = pub.publish({"dd/x": 1.0}, step=5, rules=[], keep_last=10)
        >>> seen, fired, logged
        ([5], [], {'dd/x': 1.0})
    """

    def __init__(
        self,
        *,
        label: str,
        name: str | None,
        log_per_layer: LogPerLayer,
        sinks: list[Any],
        targets: list[Target],
        warn_once: Callable[[str, str], None],
        pager: Pager | None = None,
    ) -> None:
        self.label = label
        self.pager = pager if pager is not None else Pager()
        self.name = name
        self.log_per_layer = log_per_layer
        self.sinks = sinks
        self.targets = targets
        self.alerts_fired: list[Any] = []
        self.history: list[tuple[int, dict[str, float]]] = []  # run-level keys per read
        self._warn_once = warn_once
        self._skipped: set[int] = set()  # targets that failed
        self._failed_rules: set[int] = set()
        self._published: set[str] = set()  # every key a read has published

    def publish(
        self, metrics: dict[str, float], step: int, rules: Sequence[Any], keep_last: int
    ) -> tuple[list[Any], dict[str, float]]:
        """Log a read to every target, evaluate ``rules``, page what the pager pages (rank
        zero). Returns ``(fired, named)``: every alert (paged or counted), and every key under
        this monitor's
        name (a key an earlier read published and this one lacks is NaN, never stale: a
        Trainer's ``callback_metrics`` keep every key for EarlyStopping and ModelCheckpoint)."""
        self.history.append((step, {k: v for k, v in metrics.items() if k.count("/") == 1}))
        self._log(named_metrics(select_layers(metrics, self.log_per_layer), self.name), step)
        named = named_metrics(metrics, self.name)
        for key in self._published - named.keys():
            named[key] = math.nan
        self._published |= named.keys()
        fired = self.pager.sort([self.own_alert(a) for a in self._evaluate(rules, metrics, step)])
        self.alerts_fired.extend(fired)
        for items in (self.alerts_fired, self.history):
            del items[: max(0, len(items) - keep_last)]
        if rank_zero():
            self.count_line(self.pager.closed)
            pages = [a for a in fired if getattr(a, "paged", True) is not False]
            if pages:
                self._page(pages)
        return fired, named

    def count_line(self, line: str | None) -> None:
        """Log the pager's count line of an event that ended (when there are sinks to page)."""
        if line and self.sinks:
            logger.warning(line)

    def _log(self, logged: dict[str, float], step: int) -> None:
        for target in self.targets:
            if id(target) in self._skipped:
                continue
            try:
                run = target.wandb_run()
                if run is not None:
                    define_summaries(run, target.step_key, logged)
            except Exception as err:  # noqa: BLE001 - the summaries only
                self._warn_once("summaries", f"normscope: W&B define_metric failed ({err})")
            try:
                target.log(logged, step)
            except Exception as err:  # noqa: BLE001 - that target only
                self._skipped.add(id(target))
                self._warn_once(
                    f"logger:{id(target)}",
                    f"normscope: logger {type(target.sink).__name__} failed to log "
                    f"{self.label}'s metrics and is skipped for them from now on; its other "
                    f"metrics and the other loggers are not affected ({type(err).__name__}: "
                    f"{err})",
                )

    def _evaluate(self, rules: Sequence[Any], metrics: dict[str, float], step: int) -> list[Any]:
        fired: list[Any] = []
        for rule in rules:
            if id(rule) in self._failed_rules:
                continue
            try:
                fired.extend(rule.evaluate(metrics, step))
            except Exception as err:  # noqa: BLE001 - that rule only
                self._failed_rules.add(id(rule))
                self._warn_once(
                    f"rule:{id(rule)}",
                    disabled_message(
                        f"alert rule {getattr(rule, 'name', type(rule).__name__)!r}",
                        f"{type(err).__name__}: {err}",
                        goes_on=f"{self.label} and its other rules go on",
                    ),
                )
        return fired

    def _page(self, fired: list[Any]) -> None:
        runs = self.wandb_runs()
        for alert in fired:
            for sink in list(self.sinks):
                try:
                    sink(alert, runs)
                except Exception as err:  # noqa: BLE001 - that sink only
                    self.sinks.remove(sink)
                    fn = getattr(sink, "fn", None)
                    what = getattr(fn, "__qualname__", None) or type(sink).__name__
                    self._warn_once(
                        f"sink:{id(sink)}",
                        f"normscope: alert sink {what} failed and is removed; {self.label} "
                        f"and its other sinks go on ({type(err).__name__}: {err})",
                    )

    def wandb_runs(self) -> list[Any]:
        """The W&B runs the targets write to."""
        runs = []
        for target in self.targets:
            try:
                run = target.wandb_run()
            except Exception:  # noqa: BLE001 - no run to alert on
                run = None
            if run is not None:
                runs.append(run)
        return runs

    def wandb_extras(self, family: Any, report: Any, step: int, reads: int) -> None:
        """On every W&B run a target writes to (Lightning's ``WandbLogger``, a plain loop's
        ``wandb.log``): the run's worst point in its summary, and at the first read and every
        ``charts_every_n_reads``-th the family's charts."""
        head = named_key(f"{family.prefix}/", self.name)[:-1]
        every = family.charts_every_n_reads
        for target in self.targets:
            if target.step_key is None:
                continue
            run = target.wandb_run()
            if run is None:
                continue
            note_worst(run, head, family.worst_point(report), step)
            if every and (every <= 1 or (reads - 1) % every == 0):
                payload = {
                    named_key(k, self.name): v for k, v in family.charts(report, step).items()
                }
                if payload:
                    run.log({**payload, target.step_key: step})

    def own_alert(self, alert: Any) -> Any:
        """An alert as this monitor reports it: ``monitor`` set; with a name, its key is the
        logged one (``dd[name]/...``) and its message starts with ``DeadDirectionMonitor[name]:``."""
        if not dataclasses.is_dataclass(alert) or not hasattr(alert, "monitor"):
            return alert
        if self.name is None:
            return dataclasses.replace(alert, monitor=alert.monitor or self.label)
        if alert.monitor is not None:
            return alert  # already named (a restored or re-raised alert)
        return dataclasses.replace(
            alert,
            key=named_key(alert.key, self.name),
            monitor=self.label,
            message=f"{self.label}: {alert.message}",
        )
