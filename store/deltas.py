"""A message list's ``added`` column with runs: what a list re-adds after its first change, named in its base.

A list is stored as the first ``base_len`` hashes of its base list, then ``added``. When the change is early (a
fold, an elision, a spill of an old result), everything after it is usually the base's hashes again, shifted: a
600-round session's forward lists and mirrors re-added 1.6 MB of hashes that way. ``runs`` writes such a stretch
as ``[start, count]`` (``count`` hashes of the base list from position ``start``) among the hashes; ``rebuild``
reads both forms (a list without runs is a plain JSON array of hashes, as every list before ``m013``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import cast

__all__ = ["RUNS_FROM", "rebuild", "runs"]

RUNS_FROM = 8
"""Fewer added hashes are stored as they are: a list that extends its base by a round is not searched for runs."""


def runs(base: Sequence[str], added: Sequence[str]) -> list[str | list[int]]:
    """``added`` with each stretch that stands in ``base`` in the same order as ``[start, count]`` (O(len(base) +
    len(added)))."""
    if len(added) < RUNS_FROM or not base:
        return list(added)
    where: dict[str, int] = {}
    for k, h in enumerate(base):
        where.setdefault(h, k)
    out: list[str | list[int]] = []
    k = 0
    while k < len(added):
        start = where.get(added[k])
        if start is None:
            out.append(added[k])
            k += 1
            continue
        count = 1
        while k + count < len(added) and start + count < len(base) and base[start + count] == added[k + count]:
            count += 1
        out.append([start, count] if count > 1 else added[k])
        k += count
    return out


def rebuild(base: list[str], base_len: int, added: str) -> list[str]:
    """A list from its base's hashes (the whole base list), ``base_len`` and its ``added`` column."""
    items: list[str | list[int]] = json.loads(added)
    if "[" not in added[1:]:  # no run: the common case, at C speed
        return base[:base_len] + cast(list[str], items)
    hashes = base[:base_len]
    for item in items:
        if isinstance(item, str):
            hashes.append(item)
        else:
            hashes += base[item[0]:item[0] + item[1]]
    return hashes
