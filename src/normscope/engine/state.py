"""The rules' part of a monitor's checkpoint: each rule's state under a stable key.

Example::

    >>> class Rule:
    ...     name = "r"
    ...     def __init__(self): self.n = 0
    ...     def state_dict(self): return {"n": self.n}
    ...     def load_state_dict(self, s): self.n = s["n"]
    >>> a, b = Rule(), Rule()
    >>> a.n = 3
    >>> saved = rules_state([a, a])
    >>> sorted(saved)
    ['r', 'r#2']
    >>> load_rules_state([b], saved); b.n
    3
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["load_rules_state", "rule_keys", "rules_state"]


def rule_keys(rules: Sequence[Any]) -> list[str]:
    """Each rule's key in a checkpoint: its ``name`` (its class's without one); a second rule
    of the same name ``<name>#2``, and so on."""
    keys: list[str] = []
    for rule in rules:
        base = str(getattr(rule, "name", type(rule).__name__))
        key, n = base, 1
        while key in keys:
            n += 1
            key = f"{base}#{n}"
        keys.append(key)
    return keys


def rules_state(rules: Sequence[Any]) -> dict[str, Any]:
    """``{key: rule.state_dict()}`` for every rule."""
    return {k: r.state_dict() for k, r in zip(rule_keys(rules), rules)}


def load_rules_state(rules: Sequence[Any], saved: Mapping[str, Any]) -> None:
    """Restore each rule found in ``saved`` (a rule not in it keeps its state)."""
    for key, rule in zip(rule_keys(rules), rules):
        if key in saved:
            rule.load_state_dict(saved[key])
