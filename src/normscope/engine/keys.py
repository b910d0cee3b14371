"""Key naming for several monitors in one fit: a monitor's ``name`` and the key family it logs
under.

An unnamed monitor logs ``dd/<...>`` (``sm/<...>``; per source ``dd.<source>/<...>``). A named
one logs the same keys with the name in the family: ``dd[fast]/<...>``,
``dd[fast].<source>/<...>``, ``sm[probe]/<...>``. W&B and TensorBoard group keys by the text
before the first ``/``, so each monitor gets its own section. The alert rules always see the
canonical ``dd/`` keys (:func:`named_metrics` renames only what is logged);
:func:`canonical_metrics` undoes it for a reader of a saved run.

Example::

    >>> named_metrics({"dd/sigma_min_ratio_min": 1.0, "dd.code/n_rows": 8.0}, "fast")
    {'dd[fast]/sigma_min_ratio_min': 1.0, 'dd[fast].code/n_rows': 8.0}
    >>> canonical_metrics({"dd[fast]/a": 1.0, "dd/a": 2.0}, "fast")
    {'dd/a': 1.0}
    >>> parse_family("dd[fast].code")
    ('dd', 'fast', 'code')
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

__all__ = [
    "FAMILIES",
    "canonical_metrics",
    "check_name",
    "family_names",
    "named_key",
    "named_metrics",
    "parse_family",
]

FAMILIES = ("dd", "sm")
_HEAD = re.compile(r"^(dd|sm)(?:\[([^\[\]/\s]+)\])?(?:\.(.+))?$", re.DOTALL)


def check_name(name: object, owner: str) -> str | None:
    """``name`` if it is None or a valid monitor name (a non-empty string without ``/``,
    brackets or whitespace), else ``ValueError`` naming ``owner``."""
    if name is None:
        return None
    if not isinstance(name, str) or not name or re.search(r"[/\[\]\s]", name):
        raise ValueError(
            f"{owner}: name must be None or a non-empty string without '/', '[', ']' or "
            f"whitespace (it goes into every logged key: dd[name]/...), got {name!r}"
        )
    return name


def parse_family(head: str) -> tuple[str | None, str | None, str | None]:
    """The text before a key's first ``/`` as ``(family, name, source)``: ``"dd"`` ->
    ``("dd", None, None)``, ``"dd[fast].code"`` -> ``("dd", "fast", "code")``; not a normscope
    family: ``(None, None, None)``."""
    m = _HEAD.match(head)
    if m is None:
        return None, None, None
    return m.group(1), m.group(2), m.group(3)


def named_key(key: str, name: str | None) -> str:
    """``key`` (a canonical ``dd/...``, ``dd.<source>/...`` or ``sm/...`` key) as monitor
    ``name`` logs it; unchanged for ``name=None`` or a key of no normscope family."""
    if name is None:
        return key
    head, sep, rest = key.partition("/")
    family, old, source = parse_family(head)
    if family is None or old is not None:
        return key
    return f"{family}[{name}]{'.' + source if source is not None else ''}{sep}{rest}"


def named_metrics(metrics: Mapping[str, float], name: str | None) -> dict[str, float]:
    """Every key of ``metrics`` renamed by :func:`named_key` (a new dict; the same for None)."""
    if name is None:
        return dict(metrics)
    return {named_key(k, name): v for k, v in metrics.items()}


def canonical_metrics(metrics: Mapping[str, float], name: str | None) -> dict[str, float]:
    """The keys of monitor ``name`` (``None``: the unnamed monitor) in ``metrics``, renamed
    back to their canonical ``dd/`` / ``dd.<source>/`` / ``sm/`` form; other keys dropped."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        head, sep, rest = key.partition("/")
        family, found, source = parse_family(head)
        if family is None or found != name or not sep:
            continue
        out[f"{family}{'.' + source if source is not None else ''}/{rest}"] = value
    return out


def family_names(keys: Iterable[str], family: str = "dd") -> list[str]:
    """The monitor names of ``family`` found in ``keys`` (sorted; the unnamed one left out)."""
    found = set()
    for key in keys:
        fam, name, _ = parse_family(key.partition("/")[0])
        if fam == family and name is not None:
            found.add(name)
    return sorted(found)
