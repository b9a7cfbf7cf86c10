"""What a projection did to one request, in tokens: what the agent sent, what goes upstream, and what each kind
of new cut freed. The metrics count it (``ctxproxy_tokens_freed_total{by=…}``) and the request's log line says it.

Counted with the session's own ``MessageCounter`` (ctxproxy's count, before the calibrated ratio), keyed by each
message's identity hash, so a message counted once is not counted again: only a cut message's original is counted
here, and the projection counted most of those already when they came in. Not all: a large result spilled as it
arrived was never tokenised (the spill is decided by its size). Such an original is estimated from its characters
(``MessageCounter.estimate``), not tokenised for the tally: these figures only feed the metrics and the log line,
and tokenising 16 KB takes about 4 ms. Counted on a thread after the answer, that work met the session's next
request whenever the agent sent it at once: in the 600-round run behind an instant upstream it was about a fifth
of the proxy's CPU, and the requests after the largest spills took over twice the median (issue #13). The request's path
only copies what the tally reads of the projection (``Taken``, a few list copies); ``counting`` and
``Counting.finish`` run once the answer has left. Looking up a 128k projection's ~800 cut messages in the
counter's cache took 0.7 ms of every request of a long session, before the forward went.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from ctxproxy.proxy.core import Decision, Projection
from ctxproxy.proxy.core.decisions import CUTS
from ctxproxy.proxy.core.tokens import MessageCounter

__all__ = ["Counting", "Taken", "Tally", "counting", "taken", "tally"]


@dataclass(frozen=True)
class Tally:
    tokens_in: int
    """The agent's messages and tools as it sent them (ctxproxy's count)."""
    tokens_out: int
    """What goes upstream (the projection's estimate)."""
    freed: dict[str, int] = field(default_factory=dict)
    """Tokens this request's new decisions took out, by kind (spill, elide, drop, note, fold)."""
    cuts: dict[str, int] = field(default_factory=dict)
    """This request's new decisions, by kind."""


@dataclass(frozen=True)
class Counting:
    """A request's tally as far as the counter already knew it; ``known`` estimates the cut originals it did not.
    Holds copies, not the projection's state: the session's next request extends that state in place."""

    agent: int
    """What the agent sent less what its cut messages lost (the projection's estimate, the proxy's tools out)."""
    sent: int
    cuts: dict[str, int]
    cut: list[int]
    """The indices of the messages the projection cut (changed, or folded away)."""
    stubs: list[int]
    """What each of them counts as it goes upstream (a fold's covered messages: 0, or the stub's)."""
    originals: list[int | None]
    """Each one's original, as the counter had it (or ``known`` estimated it); None: not known yet."""
    pending: Sequence[tuple[Mapping[str, Any], str]]
    """The originals not known yet, and their keys, in the order of the Nones after ``settled_cuts``."""
    new: tuple[Decision, ...]
    where: dict[str, int]
    """The index of each message id a new decision targets."""
    of: Taken | None = field(default=None, compare=False, repr=False)
    """The projection walked: the session's next tally takes this one's cuts where its own stand as these did."""
    settled: int = 0
    """What the first ``settled_cuts`` cuts took out, every original of them known: summed once, not each time."""
    settled_cuts: int = 0

    @property
    def complete(self) -> bool:
        return not self.pending

    def known(self, counter: MessageCounter) -> Counting:
        """This tally with every original known: those the counter never tokenised estimated from their characters
        (a few µs each, where tokenising a 16 KB result took 4 ms), and kept by the counter, so no later tally
        estimates them again."""
        if not self.pending:
            return self
        estimates = iter([counter.estimate(message, key) for message, key in self.pending])
        k = self.settled_cuts
        originals = self.originals[:k] + [next(estimates) if o is None else o for o in self.originals[k:]]
        return replace(self, originals=originals, pending=())

    def finish(self, counter: MessageCounter) -> Tally:
        """The tally, every original known (``known``)."""
        done = self.known(counter)
        k = done.settled_cuts
        originals = cast(list[int], done.originals[k:])  # every one known; one cast, not one a cut (~860 at 128k)
        removed = {i: original - stub  # a fold's stub: less than 0
                   for i, stub, original in zip(done.cut[k:], done.stubs[k:], originals, strict=True)}
        return Tally(done.agent + done.settled + sum(removed.values()), done.sent,
                     _freed(done.new, done.where, removed), done.cuts)


@dataclass(frozen=True)
class Taken:
    """What a tally reads of a projection, as it was when planned: the session's next request extends the state's
    lists in place, and the tally is counted once the answer has left, when the session's lock is let go."""

    hashes: list[str]
    out_hashes: list[str]
    out: list[dict[str, Any] | None]
    counts: list[int]
    ids: list[str]
    new: tuple[Decision, ...]
    estimate: int

    @property
    def cuts(self) -> dict[str, int]:
        """The projection's new decisions, by kind."""
        cuts: dict[str, int] = {}
        for d in self.new:
            cuts[d.kind] = cuts.get(d.kind, 0) + 1
        return cuts


def taken(p: Projection) -> Taken:
    """A copy of what ``counting`` reads of ``p`` (pointer copies of five lists: ~20 µs for 1,200 messages)."""
    state = p.state
    return Taken(state.hashes.copy(), state.out_hashes.copy(), state.out.copy(), state.counts.copy(),
                 state.ids.copy(), tuple(p.new), p.report.estimate)


def counting(p: Projection | Taken, messages: Sequence[dict[str, Any]], hashes: Sequence[str],
             counter: MessageCounter, sent: int, budgeted: int, last: Counting | None = None) -> Counting:
    """``sent``: the estimate of what goes upstream (the proxy's own tools or note only if listed); ``budgeted``:
    what the projection's estimate holds for them, listed or not (none of it is the agent's). ``last``: the
    session's previous tally, whose cuts are taken as they are where the projection stands as it did then
    (``_standing``), so a request that extends its session walks its new messages only: at 600 rounds a 128k
    projection cuts ~860 messages, and walking and looking up all of them took 0.6-1.1 ms of the loop's time
    after every answer (issue #13)."""
    t = p if isinstance(p, Taken) else taken(p)
    where = _places(t.ids, {d.target for d in t.new})
    start = _standing(last, t)
    if any(i < start for i in where.values()):  # a new cut among them: all walked again, as ``_freed`` needs
        start = 0
    new_cut = [i for i, (out_hash, in_hash, out) in enumerate(zip(t.out_hashes[start:], t.hashes[start:],
                                                                   t.out[start:], strict=True), start)
               if out_hash != in_hash or out is None]
    new_stubs = [t.counts[i] for i in new_cut]
    if last is not None and start:  # one lookup: the originals the last tally did not know, and the new ones
        unknown = [j for j in range(last.settled_cuts, len(last.originals)) if last.originals[j] is None]
        found = counter.known_all([hashes[last.cut[j]] for j in unknown] + [hashes[i] for i in new_cut])
        settled, settled_cuts, before = _settle(last, unknown, found[:len(unknown)])
        cut, stubs, originals = last.cut + new_cut, last.stubs + new_stubs, before + found[len(unknown):]
    else:
        settled, settled_cuts, cut, stubs = 0, 0, new_cut, new_stubs
        originals = counter.known_all([hashes[i] for i in new_cut])
    pending = [(messages[cut[j]], hashes[cut[j]]) for j in range(settled_cuts, len(cut)) if originals[j] is None]
    return Counting(t.estimate - budgeted, sent, t.cuts, cut, stubs, originals, pending, t.new, where, t, settled,
                    settled_cuts)


def _places(ids: list[str], targets: set[str]) -> dict[str, int]:
    """Each target's index among ``ids`` (its last), looked for from the end: a request's new cut is mostly of its
    newest message, and a scan of all 1,800 ids after each answer was 0.09 ms at 600 rounds."""
    where: dict[str, int] = {}
    for i in range(len(ids) - 1, -1, -1) if targets else ():
        if ids[i] in targets and ids[i] not in where:
            where[ids[i]] = i
            if len(where) == len(targets):
                break
    return where


def _standing(last: Counting | None, t: Taken) -> int:
    """How many of ``t``'s first messages stand as they did when ``last`` was counted (same identity, same message
    upstream, same count, cut or not alike), or 0: their cuts are ``last``'s. A list compared with a copy of
    itself compares its items by identity first: a few µs for 1,800 messages."""
    if last is None or last.of is None or not last.of.hashes or len(last.of.hashes) > len(t.hashes):
        return 0
    was, n = last.of, len(last.of.hashes)
    same = (t.hashes[:n] == was.hashes and t.out_hashes[:n] == was.out_hashes and t.counts[:n] == was.counts
            and t.out[:n] == was.out)
    return n if same else 0


def _settle(last: Counting, unknown: list[int], found: list[int | None]) -> tuple[int, int, list[int | None]]:
    """``last``'s settled sum carried on over all its cuts once every original of them is known (``found``: those
    of its cuts at ``unknown`` it did not know, looked up again: counted since, or estimated by its ``known``), and
    its originals as known now."""
    originals = list(last.originals)
    for j, original in zip(unknown, found, strict=True):
        originals[j] = original
    if None in found:
        return last.settled, last.settled_cuts, originals
    tail = zip(originals[last.settled_cuts:], last.stubs[last.settled_cuts:], strict=True)
    return last.settled + sum(cast(int, o) - stub for o, stub in tail), len(originals), originals


def tally(p: Projection, messages: Sequence[dict[str, Any]], hashes: Sequence[str], counter: MessageCounter,
          sent: int, budgeted: int) -> Tally:
    """``counting`` and its ``finish`` at once."""
    return counting(p, messages, hashes, counter, sent, budgeted).finish(counter)


def _freed(new: Sequence[Decision], where: Mapping[str, int], removed: Mapping[int, int]) -> dict[str, int]:
    """What each new cut took out: the tokens its message lost; a fold, every message of its span. A message cut
    twice by the same request counts once, for the cut that went upstream (a result elided and folded: the fold; a
    result spilled and then elided: the elision), so that the kinds add up to what was freed."""
    if not new:
        return {}
    spans = {d.target: (where[d.target], where[d.target] + d.count) for d in new
             if d.kind == "fold" and d.target in where}
    claimed = {i for start, end in spans.values() for i in range(start, end)}
    freed: dict[str, int] = {}
    for d in reversed(new):  # the last cut of a message is the one upstream
        i = where.get(d.target)
        if i is None or d.kind not in CUTS | {"fold"} or (d.kind != "fold" and i in claimed):
            continue
        claimed.add(i)
        start, end = spans.get(d.target, (i, i + 1)) if d.kind == "fold" else (i, i + 1)
        freed[d.kind] = freed.get(d.kind, 0) + sum(removed.get(j, 0) for j in range(start, end))
    return {kind: max(0, tokens) for kind, tokens in freed.items()}
