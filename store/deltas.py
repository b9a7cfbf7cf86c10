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

import orjson

__all__ = ["RUNS_FROM", "added_json", "rebuild", "runs"]

RUNS_FROM = 8
"""Fewer added hashes are stored as they are: a list that extends its base by a round is not searched for runs."""


def runs(base: Sequence[str], added: Sequence[str]) -> list[str | list[int]]:
    """``added`` with each stretch that stands in ``base`` in the same order as ``[start, count]`` (its first place in
    ``base``). Each hash's place is found in a dict built in C, and a stretch's length by comparing slices, in C too
    (``_agreeing``): a fold at 128k after 600 rounds journals two lists of ~600-1,800 hashes this way, walked hash by
    hash in 0.13 and 0.32 ms, now 0.07 and 0.19 (issue #13)."""
    if len(added) < RUNS_FROM or not base:
        return list(added)
    where = dict(zip(reversed(base), range(len(base) - 1, -1, -1), strict=True))  # the last kept: each's first place
    out: list[str | list[int]] = []
    k = 0
    while k < len(added):
        start = where.get(added[k])
        if start is None:
            out.append(added[k])
            k += 1
            continue
        count = _agreeing(base, start, added, k)
        out.append([start, count] if count > 1 else added[k])
        k += count
    return out


def _agreeing(base: Sequence[str], start: int, added: Sequence[str], k: int) -> int:
    """How many hashes from ``base[start]`` and ``added[k]`` on are the same (the first are): slices compared at
    lengths that double until they differ, then halve to where they part."""
    limit = min(len(base) - start, len(added) - k)
    good, step = 1, 1
    while good < limit:
        probe = min(good + step, limit)
        if base[start + good:start + probe] != added[k + good:k + probe]:
            break
        good, step = probe, 2 * step
    else:
        return good
    low, high = good, probe  # the first ``low`` agree; one of those before ``high`` does not
    while high - low > 1:
        middle = (low + high) // 2
        if base[start + low:start + middle] == added[k + low:k + middle]:
            low = middle
        else:
            high = middle
    return low


def added_json(added: Sequence[str | list[int]]) -> str:
    """An ``added`` column's text: the JSON array, compact. Written by orjson: the stdlib's ``json.dumps`` of a
    mirror's first list (~630 hashes) was 0.2 ms of the request that turns the mirror on at 128k, and lists written
    before, with the stdlib's spaces, read back the same (issue #13)."""
    return orjson.dumps(added).decode()


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
