"""The dead-direction monitor's default alert rules, built in one place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from normscope.alerts.rules import KernelLossRule
from normscope.alerts.sigma import SigmaMinRatioRule
from normscope.alerts.sources import SourceCollapseRule

__all__ = ["default_dead_direction_rules"]


def default_dead_direction_rules(
    kinds: Mapping[str, str],
    sublayers: Mapping[str, str | None] | None,
    *,
    sources: bool = False,
    sigma_rule: SigmaMinRatioRule | None = None,
    kernel_rule: KernelLossRule | None = None,
    kernel: bool = True,
) -> list[Any]:
    """The default rules of :class:`~normscope.callbacks.DeadDirectionMonitor`, in the order
    they are evaluated: a :class:`SigmaMinRatioRule` (``SigmaMinRatioRule()`` unless
    ``sigma_rule``), a :class:`KernelLossRule` (``KernelLossRule()`` unless ``kernel_rule``;
    none with ``kernel=False``), then with ``sources`` a :class:`SourceCollapseRule` on the
    sigma rule. The monitor, ``normscope scan`` and ``normscope report`` all build theirs here.

    ``kinds`` maps norm paths to their declared kind (the kernel rule's ``kinds``);
    ``sublayers`` maps the residual points, in depth order, to their sublayer (the sigma and
    source rules' ``sublayers``). ``sublayers=None`` means no residual rules: a post-norm model,
    or no profile, whose ``sigma_min`` the theory does not cover.

    Example::

        >>> rules = default_dead_direction_rules({"ln_f": "layernorm"}, {"h.0": "attn"})
        >>> [r.name for r in rules]
        ['sigma_min_collapse', 'layernorm_kernel_lost']
        >>> [r.name for r in default_dead_direction_rules({}, {}, sources=True, kernel=False)]
        ['sigma_min_collapse', 'source_collapse']
        >>> [r.name for r in default_dead_direction_rules({}, None, sources=True)]
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
    return rules
