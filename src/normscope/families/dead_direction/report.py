"""The records of a dead-direction read: :class:`NormReport` (one norm layer),
:class:`DeadDirectionReport` (the whole model, flat keys as logged: docs/metrics.md §3) and the
note on inputs that do not span."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from normscope.alerts.sources import classify_collapses, collapse_keys, source_reads
from normscope.functional.dead_direction import GammaRead, KernelRead, SchurRead
from normscope.functional.depth import DepthRead
from normscope.functional.profile import SigmaMinProfile
from normscope.taps.paths import key_path
from normscope.taps.residual import ResidualLayout

FAMILY = "dd"  # the key family of the dead-direction reads

__all__ = [
    "DeadDirectionReport",
    "FAMILY",
    "KIND",
    "NORM_CLASS_CODE",
    "NormReport",
    "cheap_key",
    "rank_deficiency_note",
]

#: the family's name in messages and alerts (the Lightning callback's class name)
KIND = "DeadDirectionMonitor"
NORM_CLASS_CODE = {"layernorm-like": 1.0, "rmsnorm-like": -1.0, "indeterminate": 0.0}

#: what a cheap read logs per norm layer, residual point and attention module (the last part of
#: ``dd/<path>/<metric>``) and of the run (``dd/<metric>``); every other key is the spectral
#: tier's (docs/costs.md, "Tiers")
CHEAP_METRICS = frozenset(
    {
        "dead_channels", "gamma_min", "gamma_max", "gamma_spread", "n_rows",
        "offset_share", "rms", "rms_growth", "out_offset_share", "gamma_scale",
        "gamma_crossed", "max_logit",
    }
)  # fmt: skip
CHEAP_SUMMARIES = frozenset(
    {
        "rows_rejected", "reads_disabled", "nonfinite_share", "offset_share_max",
        "rms_growth_max", "gamma_scale_min", "gamma_scale_max", "gamma_crossed_max",
        "final_offset_share", "final_out_offset_share", "final_rows_per_dim",
        "attn_logit_max", "attn_modules_read", "stream_failed",
        "final_out_offset_share_init", "final_out_rows_init", "final_out_init_step",
    }
)  # fmt: skip


def cheap_key(key: str) -> bool:
    """Whether a cheap read computes ``key`` (a logged ``dd/...`` key); False: a key of the
    spectral tier, absent from a cheap read's metrics.

    Example::

        >>> cheap_key("dd/h.0.ln_1/gamma_min"), cheap_key("dd/h.0.ln_1/kernel_residual")
        (True, False)
        >>> cheap_key("dd/rows_rejected"), cheap_key("dd/sigma_min_ratio_min")
        (True, False)
    """
    if not key.startswith(f"{FAMILY}/"):
        return False  # the per-source reads (dd.<source>/...) are the profile's
    rest = key[len(FAMILY) + 1 :]
    if "/" not in rest:
        return rest in CHEAP_SUMMARIES
    return rest.rsplit("/", 1)[1] in CHEAP_METRICS


@dataclass(frozen=True)
class NormReport:
    """Every read of one norm layer (docs/metrics.md §1.1–1.3): ``gamma``, the kernel reads of
    its output, and of its input the Schur quotient (``schur``: ``R`` and ``s``, no baseline)
    and ``v*``'s depth beyond the typical direction with its random-direction control
    (``depth``: ``delta_gamma``, ``delta_gamma_control``...). A cheap read's
    (``spectral=False``) has ``gamma`` and ``n_rows`` only: its ``schur`` and ``depth`` are
    None and :meth:`as_dict` holds the cheap keys."""

    name: str
    kind: str
    gamma: GammaRead
    kernel: KernelRead
    schur: SchurRead | None
    depth: DepthRead | None
    n_rows: int
    #: the input covariance's ``(eigenvalues, eigenvectors)`` while the read is solved (the
    #: residual point this norm reads takes its ``sigma_min`` from it); dropped before the
    #: report leaves the solve
    spectrum: Any = field(default=None, repr=False, compare=False)
    #: the spectral tier was read (False: a cheap read's gamma and row count only)
    spectral: bool = True

    @property
    def delta_gamma(self) -> float:
        """``1 - 10^-depth``: 0 for a typical direction, -> 1 as ``v*`` sits deeper (NaN on a
        cheap read)."""
        return self.depth.delta_gamma if self.depth is not None else math.nan

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        out.update(self.gamma.as_dict())
        if not self.spectral or self.schur is None or self.depth is None:
            out["n_rows"] = float(self.n_rows)
            return out
        out.update(self.kernel.as_dict())
        out["kernel_alignment"] = self.kernel.kernel_alignment
        out["schur_quotient"] = self.schur.schur_quotient
        out["schur_complement"] = self.schur.schur_complement
        out.update(self.depth.as_dict())
        # norm_class as a number (loggers take numbers): +1 layernorm-like, -1 rmsnorm-like,
        # 0 indeterminate, NaN when not read.
        out["norm_class"] = NORM_CLASS_CODE.get(self.kernel.norm_class, math.nan)
        out["n_rows"] = float(self.n_rows)
        return out


@dataclass(frozen=True)
class DeadDirectionReport:
    """One read of a whole model: ``norms`` by module path, the ``profile``, row counts.

    ``as_dict()`` is flat and keyed as the monitor logs (docs/metrics.md §3): ``dd/<module path>/<metric>``
    for each norm and residual point, ``dd/<metric>`` for the run-level summaries.
    """

    step: int
    norms: dict[str, NormReport]
    profile: SigmaMinProfile | None
    layout: ResidualLayout | None
    rows_rejected: int
    failed_taps: dict[str, str] = field(default_factory=dict)
    #: per-source depth profiles (``sources=``), by source name; empty without sources
    sources: dict[str, SigmaMinProfile] = field(default_factory=dict)
    #: the rule whose threshold classifies a collapse (``SigmaMinRatioRule()`` if None)
    source_rule: Any = None
    #: the stream reads (docs/metrics.md §1.6), keyed as logged without ``dd/``:
    #: ``<point>/offset_share``, ``<norm>/rankme``, ``gamma_scale_min``... (:func:`stream_keys`)
    stream: dict[str, float] = field(default_factory=dict)
    #: the spectral tier was read (False: a cheap read, only :func:`cheap_key` keys)
    spectral: bool = True

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, norm in self.norms.items():
            for metric, value in norm.as_dict().items():
                out[f"{FAMILY}/{key_path(name)}/{metric}"] = float(value)
        if self.profile is not None:
            for key, value in self.profile.as_dict().items():
                out[f"{FAMILY}/{key_path(key)}"] = float(value)
            steps = [p.sigma_min_step for p in self.profile.points[1:]]
            steps = [s for s in steps if math.isfinite(s)]
            out[f"{FAMILY}/sigma_min_step_min"] = min(steps) if steps else math.nan
        out[f"{FAMILY}/rows_rejected"] = float(self.rows_rejected)
        if self.spectral:
            # the residual points this read covers: 0 says "no sigma_min profile" out loud
            out[f"{FAMILY}/profile_points"] = (
                float(len(self.profile.points)) if self.profile is not None else 0.0
            )
            # reads the fast solvers could not verify, answered by the dense eigh instead
            out[f"{FAMILY}/solver_fallbacks"] = float(self.solver_fallbacks)
        # layers (norms, residual points, the profile) no longer read after a failure
        out[f"{FAMILY}/reads_disabled"] = float(
            len({key.rsplit(":", 1)[0] for key in self.failed_taps})
        )
        if self.norms and self.spectral:
            # the headline: each LayerNorm's kernel_alignment (its subspace alignment when the
            # input does not span and the null space is degenerate, else gamma_alignment)
            aligned = [
                n.kernel.kernel_alignment for n in self.norms.values() if n.kind == "layernorm"
            ]
            aligned = [a for a in aligned if not math.isnan(a)]
            if aligned:
                out[f"{FAMILY}/gamma_alignment_min"] = min(aligned)
            deltas = [n.delta_gamma for n in self.norms.values() if math.isfinite(n.delta_gamma)]
            out[f"{FAMILY}/delta_gamma_max"] = max(deltas) if deltas else math.nan
            out[f"{FAMILY}/rank_deficient_inputs"] = float(len(self.rank_deficient_norms))
        if self.profile is not None:
            # 0: the ratios read against p_0; k > 0: the first k points did not span
            out[f"{FAMILY}/profile_anchor_depth"] = float(self.profile.anchor_depth)
        if self.sources:
            out.update(source_reads(self.sources, key_path))
            out.update(collapse_keys(out, self.source_rule))
        for key, value in self.stream.items():
            out[f"{FAMILY}/{key_path(key)}"] = float(value)
        return out

    @property
    def collapses(self) -> list:
        """The classified collapses (:func:`normscope.alerts.classify_collapses`);
        empty without sources."""
        if not self.sources:
            return []
        return classify_collapses(self.as_dict(), self.source_rule)

    @property
    def rank_deficient_norms(self) -> list[str]:
        """The norm layers whose input does not span (``depth.live_dim < d``: a ViT's small
        patches, a vocabulary under ``d``) or whose output's null space is degenerate
        (``null_dim > 1``): their reads are taken on the live subspace."""
        return [
            name
            for name, n in self.norms.items()
            if n.depth is not None
            and n.depth.rank_deficient
            or (
                isinstance(n.kernel.null_dim, int)
                and n.kernel.null_dim > 1
                and n.gamma.dead_channels == 0
            )
        ]

    @property
    def solver_fallbacks(self) -> int:
        """Dense fallbacks in this read (:mod:`normscope.functional.solvers`): the norms'
        kernel reads plus the points of the profile and of every source's profile."""
        profiles = ([self.profile] if self.profile is not None else []) + list(
            self.sources.values()
        )
        return sum(getattr(n.kernel, "dense_fallbacks", 0) for n in self.norms.values()) + sum(
            getattr(p, "dense_fallbacks", 0) for p in profiles
        )

    @property
    def sigma_min_ratio_min(self) -> float:
        return self.profile.sigma_min_ratio_min if self.profile is not None else math.nan


def rank_deficiency_note(report: DeadDirectionReport) -> str | None:
    """What a read says about inputs that do not span (None when everything spans): which
    norm layers are read on their live subspace and where the ``sigma_min`` ratios anchor.
    The monitor warns with it once; ``normscope scan`` prints it.

    Example::

        >>> rank_deficiency_note(DeadDirectionReport(0, {}, None, None, 0)) is None
        True
    """
    parts = []
    names = report.rank_deficient_norms
    if names:
        shown = ", ".join(key_path(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
        parts.append(
            f"{len(names)} norm layer(s) see inputs that do not span their width ({shown}): "
            "their reads are taken on the live subspace (dd/<layer>/live_dim < d) and "
            "dd/gamma_alignment_min is their subspace alignment"
        )
    profile = report.profile
    if profile is not None and profile.anchor_depth > 0 and profile.anchor is not None:
        parts.append(
            f"the first {profile.anchor_depth} residual point(s) do not span, so the sigma_min "
            f"ratios are read against {key_path(profile.anchor)} "
            f"(dd/profile_anchor_depth = {profile.anchor_depth})"
        )
    if not parts:
        return None
    return (
        "; ".join(parts) + ". Typical of small ViT patches or a vocabulary smaller than the "
        "width; the reads stay exact on what the data spans."
    )
