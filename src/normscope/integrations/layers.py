"""``log_per_layer``: which per-layer keys a monitor sends to its loggers.

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
from collections.abc import Mapping

__all__ = ["check_log_per_layer", "select_layers"]

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
