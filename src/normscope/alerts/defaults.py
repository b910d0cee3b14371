"""The dead-direction monitor's default alert rules, built in one place (the monitor,
``normscope scan`` and ``normscope report`` all build theirs here)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from normscope.alerts.attention import AttentionLogitRule
from normscope.alerts.sigma_min import SigmaMinRatioRule
from normscope.alerts.sources import SourceCollapseRule
from normscope.alerts.stream import (
    GainDriftRule,
    NonFiniteRule,
    RepresentationCollapseRule,
    ScaleGrowthRule,
)
from normscope.alerts.weights import KernelLossRule

__all__ = ["default_dead_direction_rules"]


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
    objective: str = "tokens",
) -> list[Any]:
    """The default rules of :class:`~normscope.adapters.lightning.DeadDirectionMonitor`, in the
    order they are evaluated: a :class:`SigmaMinRatioRule` (``SigmaMinRatioRule()`` unless
    ``sigma_rule``), a :class:`KernelLossRule` (``KernelLossRule()`` unless ``kernel_rule``;
    none with ``kernel=False``), then with ``sources`` a :class:`SourceCollapseRule` on the
    sigma rule, then a :class:`NonFiniteRule` (none with ``nonfinite=False``), then the stream
    rules :class:`RepresentationCollapseRule`, :class:`GainDriftRule` and
    :class:`ScaleGrowthRule` (none with ``stream=False``; post-norm models included: they read
    no premise), then an :class:`AttentionLogitRule` (none with ``attention=False``).
    ``objective`` is the collapse rule's (``"tokens"``: a language model; ``"embedding"``:
    embeddings trained to agree, see :class:`RepresentationCollapseRule`).

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
        collapse = RepresentationCollapseRule(objective=objective)
        rules += [collapse, GainDriftRule(), ScaleGrowthRule()]
    if attention:
        rules.append(AttentionLogitRule())
    return rules
