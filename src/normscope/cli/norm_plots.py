"""The run report's per-norm figures: ``alignment.png``, ``gamma.png`` and ``schur.png``, one
metric per panel over training steps, each norm drawn against its own kind's expectations
(a LayerNorm's exact kernel; an RMSNorm has none and is held to nothing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from normscope.cli.figures import (
    KERNEL_ALERT,
    LEGEND_KEY,
    LEGEND_MAX,
    any_finite,
    depth_colours,
    depth_scale,
    log_floor,
    mark_alerts,
    name_worst,
    new_figure,
    run_series,
    save,
    say_empty,
    short_names,
    step_span,
    titled,
)

__all__ = ["KIND_STYLE", "WORST", "kernel_verdict", "plot_norm_metrics"]

Reads = Mapping[float, Mapping[str, float]]


WORST = {"gamma_alignment": "min", "gamma_min": "min"}  # else the largest value is the worst
KIND_STYLE = {"layernorm": "-", "rmsnorm": "--"}


def plot_norm_metrics(
    reads: Reads,
    layers: Sequence[str],
    panels: Sequence[tuple[str, str, bool]],
    alerts: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    title: str,
    hlines: Mapping[str, Sequence[tuple[float, str, str | None]]] | None = None,
    kinds: Mapping[str, str] | None = None,
    empty: Mapping[str, str] | None = None,
    verdict: str = "",
) -> Path | None:
    """One panel per ``(metric, y label, log axis)``: that metric of every layer over steps,
    alerts marked. ``hlines`` maps a metric to reference lines ``(y, label, kind)``, drawn only
    when a layer of that kind (None: any) is drawn in the panel; ``kinds`` (layer -> declared
    kind) draws RMSNorms dashed, LayerNorms solid; ``empty`` says why a metric may have nothing
    to draw (written in its panel). Up to ``LEGEND_MAX`` layers are named in the legend, more
    get a depth colour scale and the worst three named (``WORST``: the lowest
    ``gamma_alignment`` and ``gamma_min``, the highest of the rest). Returns None, writing
    nothing, when no panel has anything to draw."""
    kinds = kinds or {}
    drawn_any = any(any_finite(reads, f"dd/{layer}/{m}") for m, _, _ in panels for layer in layers)
    if not drawn_any:
        return None
    fig = new_figure(9.0, 2.8 * len(panels) + 0.6)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    colours = dict(zip(layers, depth_colours(len(layers))))
    labels = dict(zip(layers, short_names(layers)))
    many = len(layers) > LEGEND_MAX
    named = False
    for ax, (metric, ylabel, log) in zip(axes, panels):
        if log:
            ax.set_yscale("log")
        else:
            ax.ticklabel_format(axis="y", useOffset=False)  # 1.000000, not "+1" and 1e-6s
        here = [layer for layer in layers if any_finite(reads, f"dd/{layer}/{metric}")]
        ends = []
        for layer in here:
            steps, values = run_series(reads, f"dd/{layer}/{metric}")
            shown = log_floor(values)[0] if log else values
            label = labels[layer] if not (many or named) else None
            ax.plot(steps, shown, KIND_STYLE.get(kinds.get(layer, ""), "-"), marker=".", ms=3,
                    lw=1, color=colours[layer], label=label)  # fmt: skip
            i = int(np.nanargmin(values) if WORST.get(metric) == "min" else np.nanargmax(values))
            ends.append((float(values[i]), float(steps[i]), float(shown[i]), labels[layer]))
        if here and not many:
            named = True
        drawn_kinds = {kinds.get(layer) for layer in here}
        for y, lab, kind in (hlines or {}).get(metric, ()):
            if here and (kind is None or kind in drawn_kinds):
                ax.axhline(y, color="black", lw=0.8, ls=":", label=lab)
        if not here:
            say_empty(ax, (empty or {}).get(metric, f"no finite {metric} in any read"))
        mark_alerts(ax, alerts, label=ax is axes[0])
        step_span(ax, reads)
        if many and ends:  # after every line that moves the limits
            ends.sort(reverse=WORST.get(metric) != "min")
            name_worst(ax, [(x, y, lab) for _, x, y, lab in ends[:3]])
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        if "rmsnorm" in drawn_kinds and len(drawn_kinds - {None}) > 1:
            for kind, style in KIND_STYLE.items():
                ax.plot(
                    [],
                    [],
                    style,
                    color="0.3",
                    label=f"{kind} ({'solid' if style == '-' else 'dashed'})",
                    gid=LEGEND_KEY,
                )
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=2, loc="best")
    if many:
        depth_scale(fig, list(axes), [labels[layer] for layer in layers], "norm layer")
    axes[0].set_title(titled(title, verdict) if verdict else title, fontsize=9)
    axes[-1].set_xlabel("training step")
    return save(fig, path)


def kernel_verdict(reads: Reads, layers: Sequence[str], kinds: Mapping[str, str]) -> str:
    """The line under ``alignment.png``'s title: how many LayerNorms keep the exact kernel at
    every read (``kernel_residual <= 1e-4``, the default rule) or where it was lost, and the
    RMSNorms, which have no kernel by design and are not held to it.

    Example::

        >>> reads = {2.0: {"dd/a/kernel_residual": 1e-15, "dd/b/kernel_residual": 0.2},
        ...          4.0: {"dd/a/kernel_residual": 3e-3, "dd/b/kernel_residual": 0.1}}
        >>> kernel_verdict(reads, ["a", "b"], {"a": "layernorm", "b": "rmsnorm"})
        'kernel LOST at a (step 4); 0/1 LayerNorms keep it; 1 RMSNorm: no kernel by design, no kernel alert (dashed)'
    """
    names = dict(zip(layers, short_names(layers)))
    ln = [layer for layer in layers if kinds.get(layer, "layernorm") == "layernorm"]
    rms = [layer for layer in layers if kinds.get(layer) == "rmsnorm"]
    parts, lost, kept, worst = [], [], 0, 0.0
    for layer in ln:
        steps, values = run_series(reads, f"dd/{layer}/kernel_residual")
        ok = np.isfinite(values)
        if not ok.any():
            continue
        over = steps[ok & (values > KERNEL_ALERT)]
        if over.size:
            lost.append(f"{names[layer]} (step {over[0]:g})")
        else:
            kept += 1
            worst = max(worst, float(values[ok].max()))
    if lost:
        more = f" (+{len(lost) - 3})" if len(lost) > 3 else ""
        parts.append(
            f"kernel LOST at {', '.join(lost[:3])}{more}; {kept}/{len(ln)} LayerNorms keep it"
        )
    elif kept:
        parts.append(f"{kept}/{len(ln)} LayerNorms keep the exact kernel at every read "
                     f"(kernel_residual <= {worst:.0e})")  # fmt: skip
    if rms:
        dashed = " (dashed)" if ln else ""
        parts.append(f"{len(rms)} RMSNorm{'s' if len(rms) > 1 else ''}: no kernel by design, "
                     f"no kernel alert{dashed}")  # fmt: skip
    return "; ".join(parts)
