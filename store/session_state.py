"""A session's working state, journaled: the offer, the reminder, pending confirmations and the live mirror.

The projection is rebuilt from the decisions; these few values are not derived from anything else, and losing
them (a restart, a session evicted from the proxy's working cache) changed what went upstream: an offer vanished
mid-turn (the tool list changed, the prefix cache broke), a confirmation was never told, the reminder came twice,
a draft of the mirror was overwritten. Each change is one row; the newest row of a session is its state. The
mirror's text as last written is kept as its pieces (its entries, content-addressed blobs stored once however many
versions hold them) listed like a request's messages, delta-encoded against the previous version.

Plain functions over a ``Journal`` (``writer.call(record_session_state, ...)``), so the Journal class stays as is.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, NamedTuple

from ctxproxy.store.cuts import ForwardRecord
from ctxproxy.store.deltas import runs
from ctxproxy.store.journal import Journal
from ctxproxy.store.reads import chain

__all__ = ["MIRROR_SEPARATOR", "CalibrationInForce", "SessionState", "StateChange", "calibration_in_force",
           "latest_calibration", "record_forward_and_state", "record_session_state", "session_state"]

MIRROR_SEPARATOR = "\n    },\n    {\n"
"""Where the mirror's text is cut into pieces for the journal: between two of its entries, as
``proxy.tools.mirror.mirror_document`` lays them out (any text splits and joins back the same; this one makes the
pieces the entries, which repeat from one version of the mirror to the next)."""
_MIRROR_TAIL = "\n    }\n  ]\n}"
"""How the mirror ends: a piece of its own (the last), so the newest entry is the same piece in the next version."""
_EARLIER_SEPARATOR = "\n  },\n  {\n"
"""The separator of the mirrors journaled before their indent became two spaces (issue #13): such a mirror's first
piece begins ``_EARLIER_HEAD``, and its pieces are joined back with this one."""
_EARLIER_HEAD = '{\n "session": '

_MAX_DEPTH = 64
"""A mirror's list is stored whole rather than as the 65th delta of a chain: a read rebuilds at most 64 rows (in
one query). A whole list is ~67 bytes a piece: every 17th, as before runs, was most of the mirror's lists."""


@dataclass(frozen=True)
class SessionState:
    offered_turn: str | None = None
    reminded_turn: str | None = None
    confirmations: tuple[str, ...] = ()
    mirror: str | None = None
    """Where LIVE_CONTEXT.json is written (None: the mirror is off)."""
    mirror_text: str | None = None
    """The mirror as last written, while a draft of it may be pending (None once committed or refused)."""


def record_session_state(journal: Journal, session_id: str, request_id: int, state: SessionState,
                         created_at: str, previous: SessionState | None = None, extends: bool = False) -> None:
    """Journal the session's state as it is after ``request_id`` changed it. ``previous``: the state as last
    journaled, if the caller knows it (a mirror that only grew since is journaled as what it gained). ``extends``:
    the caller made ``state``'s mirror by adding entries to ``previous``'s, so its start is not compared again
    (0.2-0.5 ms of each request of a long session at 128k, whose mirror holds some 300 000 characters)."""
    with journal.conn:
        mirror_list = None if state.mirror_text is None else _record_mirror(
            journal, session_id, state.mirror_text, None if previous is None else previous.mirror_text, extends)
        journal.conn.execute(
            "INSERT INTO session_state (session_id, request_id, offered_turn, reminded_turn, confirmations, mirror,"
            " mirror_list, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [session_id, request_id, state.offered_turn, state.reminded_turn, json.dumps(list(state.confirmations)),
             state.mirror, mirror_list, created_at])


class StateChange(NamedTuple):
    """A working state to journal: ``record_session_state``'s arguments after the journal."""

    session_id: str
    request_id: int
    state: SessionState
    created_at: str
    previous: SessionState | None = None
    extends: bool = False


def record_forward_and_state(journal: Journal, rec: ForwardRecord, change: StateChange | None) -> int:
    """``Journal.record_forward`` and, when the request changed it, the working state it left, in one transaction:
    one commit and one trip to the writer thread where a forward with new cuts and a grown mirror took two (issue
    #13). Returns the forward's list."""
    with journal.conn:  # the two calls' own transactions join this one
        list_id = journal.record_forward(rec)
        if change is not None:
            record_session_state(journal, *change)
    return list_id


def session_state(journal: Journal, session_id: str) -> SessionState:
    """The session's latest journaled state (the defaults when nothing was journaled)."""
    row = journal.conn.execute(
        "SELECT s.offered_turn, s.reminded_turn, s.confirmations, s.mirror, b.body, s.mirror_list FROM session_state s"
        " LEFT JOIN blobs b ON b.hash = s.mirror_hash WHERE s.session_id = ? ORDER BY s.id DESC LIMIT 1",
        [session_id]).fetchone()
    if row is None:
        return SessionState()
    offered, reminded, confirmations, mirror, text, mirror_list = row
    if mirror_list is not None:
        text = _joined(_pieces(journal, _mirror_hashes(journal, int(mirror_list))[0]))
    return SessionState(offered, reminded, tuple(json.loads(confirmations)), mirror, text)


def _record_mirror(journal: Journal, session_id: str, text: str, previous: str | None = None,
                   extends: bool = False) -> int:
    """The mirror's text as its pieces (split at ``MIRROR_SEPARATOR``: one a message, mostly; the closing brackets
    the last piece), each a blob stored once, listed like a request's messages: delta-encoded against the session's
    previous mirror. Stored whole on every change, the mirror took 57 MB of a 600-round session's journal for 6.7 MB
    of history. Only the pieces the previous mirror does not list are offered to ``blobs`` (its pieces are stored,
    and kept while its list is): a mirror rewritten on every request of a long session offered all of its ~650
    pieces each time, ~1 ms of the journal's time per request at 600 rounds (issue #13). A mirror that only gained
    entries since ``previous`` (the text last journaled) is split, hashed and listed only where it grew; for one
    rewritten whole, the previous list's hashes are the ones this connection inserted, not read back along its
    chain, and its pieces' hashes are mostly looked up (``_piece_hash``)."""
    row = journal.conn.execute(_LAST_MIRROR, [session_id]).fetchone()
    known = journal.grown_mirrors.get(session_id)
    if row is not None and previous is not None:
        grown = _record_growth(journal, int(row[0]), int(row[1]), text, previous, extends, known)
        if grown is not None:
            return _grown(journal, session_id, grown[0], grown[1], text, grown[2])
    before, depth = ([], 0) if row is None else _previous_list(journal, int(row[0]), known, previous)
    tail = _MIRROR_TAIL if text.endswith(_MIRROR_TAIL) else ""
    hashes = _offer_pieces(journal, [*text[: len(text) - len(tail)].split(MIRROR_SEPARATOR), tail], set(before))
    if row is None or depth >= _MAX_DEPTH:
        return _grown(journal, session_id, *_insert_mirror_list(journal, None, [], 0, hashes), text, hashes)
    same = next((i for i, (a, b) in enumerate(zip(before, hashes, strict=False)) if a != b),
                min(len(before), len(hashes)))
    return _grown(journal, session_id, *_insert_mirror_list(journal, int(row[0]), before, same, hashes, depth), text,
                  hashes)


def _previous_list(journal: Journal, list_id: int, known: Grown | None, previous: str | None) -> tuple[list[str], int]:
    """The hashes of the session's last mirror list and its chain's depth: as this connection inserted it when
    ``known`` is that list's, inserted for ``previous`` (the text the caller last journaled, that very object: a
    list row never changes, but a session pruned and begun again could have its id back), else read along its
    chain (0.3-0.6 ms at 128k)."""
    if known is not None and known[0] == list_id and known[1] is previous and known[3] is not None:
        return known[3], known[2]
    return _mirror_hashes(journal, list_id)


_GROWN_KEPT = 8
"""How many sessions' last mirror list a journal connection keeps (``Journal.grown_mirrors``): the next version
that grows a mirror from that very text (the same object) is known to be that list's, and its chain's depth,
without counting the ~650 separators of ~300 000 characters and walking the chain in SQL (0.3-0.5 ms of each
request that grows the mirror at 128k, issue #13); a version rewritten whole (after a fold, an elision pass) is
compared with that list's hashes, kept with it, not read back. The texts are held: a few sessions, cleared whole
when full."""

Grown = tuple[int, str, int, list[str] | None]
"""``Journal.grown_mirrors``' entry: the list, its text, its chain's depth, its hashes (None when not known)."""
_TAIL_HASH = hashlib.sha256(_MIRROR_TAIL.encode()).hexdigest()


def _grown(journal: Journal, session_id: str, list_id: int, depth: int, text: str,
           hashes: list[str] | None = None) -> int:
    kept = journal.grown_mirrors
    if len(kept) >= _GROWN_KEPT and session_id not in kept:
        kept.clear()
    kept[session_id] = (list_id, text, depth, hashes)
    return list_id


_LAST_MIRROR = ("SELECT s.mirror_list, l.length FROM session_state s JOIN message_lists l ON l.id = s.mirror_list"
                " WHERE s.session_id = ? AND s.mirror_list IS NOT NULL ORDER BY s.id DESC LIMIT 1")
_DEPTH = f"""
WITH RECURSIVE chain(id, base_id, depth) AS (
    SELECT id, base_id, 1 FROM message_lists WHERE id = ?
    UNION ALL
    SELECT l.id, l.base_id, c.depth + 1 FROM message_lists l JOIN chain c ON l.id = c.base_id
     WHERE c.depth < {_MAX_DEPTH}
)
SELECT MAX(depth) FROM chain
"""
"""How many lists a delta chain has, up to ``_MAX_DEPTH``: counted in SQL, none of them read."""


def _record_growth(journal: Journal, list_id: int, length: int, text: str, previous: str, extends: bool = False,
                   known: Grown | None = None) -> tuple[int, int, list[str] | None] | None:
    """``text`` as a delta on ``list_id``, the list of ``previous``, when ``text`` is ``previous`` with pieces added
    before its tail (compared unless the caller says it ``extends`` it) and that list is ``previous``'s (their
    lengths agree, or ``known``, ``Journal.grown_mirrors``' entry, says so); None otherwise. Only the new pieces are
    hashed and offered to ``blobs``. Returns the new list, how many lists its chain has, and its hashes when
    ``known`` had those of the list it extends."""
    kept = len(previous) - len(_MIRROR_TAIL)
    known = known if known is not None and known[0] == list_id and known[1] is previous else None
    if (not previous.endswith(_MIRROR_TAIL) or not text.endswith(_MIRROR_TAIL) or len(text) <= len(previous)
            or not (extends or text.startswith(previous[:kept])) or not text.startswith(MIRROR_SEPARATOR, kept)
            or (known is None and previous.count(MIRROR_SEPARATOR, 0, kept) + 2 != length)):
        return None
    depth = known[2] if known is not None else journal.conn.execute(_DEPTH, [list_id]).fetchone()[0]
    if depth >= _MAX_DEPTH:
        return None
    hashes = _offer_pieces(journal, text[kept + len(MIRROR_SEPARATOR): len(text) - len(_MIRROR_TAIL)]
                           .split(MIRROR_SEPARATOR))
    tail = _TAIL_HASH  # stored with the list this one extends
    grown = journal.conn.insert("INSERT INTO message_lists (base_id, base_len, added, length) VALUES (?, ?, ?, ?)",
                                [list_id, length - 1, json.dumps([*hashes, tail]), length + len(hashes)])
    whole = None if known is None or known[3] is None else [*known[3][:-1], *hashes, tail]
    return grown, depth + 1, whole


_PIECE_HASHES: dict[str, str] = {}
"""The sha256 of the mirror's pieces last hashed, by their text: a mirror rewritten whole (after a fold, an
elision pass) repeats all but a few of its ~650 pieces, and hashing them again was 1.3 ms of such a request at
128k; looking a piece up hashes it too, but with Python's own string hash, several times faster. Cleared whole
when full (a few MB of pieces at most)."""
_PIECE_HASHES_KEPT = 8192


def _piece_hash(piece: str) -> str:
    known = _PIECE_HASHES.get(piece)
    if known is None:
        if len(_PIECE_HASHES) >= _PIECE_HASHES_KEPT:
            _PIECE_HASHES.clear()
        known = _PIECE_HASHES[piece] = hashlib.sha256(piece.encode()).hexdigest()
    return known


def _offer_pieces(journal: Journal, pieces: list[str], stored: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The pieces' hashes; each piece whose hash is not in ``stored`` offered to ``blobs`` (kept once)."""
    hashes = [_piece_hash(p) for p in pieces]
    journal.conn.executemany("INSERT INTO blobs (hash, kind, body, chars) VALUES (?, 'mirror', ?, ?)"
                             " ON CONFLICT DO NOTHING",
                             [(h, p, len(p)) for h, p in zip(hashes, pieces, strict=True) if h not in stored])
    return hashes


def _insert_mirror_list(journal: Journal, base_id: int | None, base: list[str], same: int, hashes: list[str],
                        depth: int = 0) -> tuple[int, int]:
    """A mirror's list after the first ``same`` pieces of the previous one (``base_id``, whose pieces are ``base``
    and whose chain has ``depth`` lists): the rest as runs of ``base`` where they repeat it (an early change keeps
    the later entries) and new hashes. Returns the list and how many lists its chain has."""
    added = runs(base, hashes[same:])
    if not same and all(isinstance(item, str) for item in added):
        base_id = None
    list_id = journal.conn.insert("INSERT INTO message_lists (base_id, base_len, added, length) VALUES (?, ?, ?, ?)",
                                  [base_id, same, json.dumps(added), len(hashes)])
    return list_id, 1 if base_id is None else depth + 1


def _mirror_hashes(journal: Journal, list_id: int) -> tuple[list[str], int]:
    """A mirror's piece hashes, and how many lists its delta chain has (bounded by ``_MAX_DEPTH``)."""
    return chain(journal.conn, list_id)


def _pieces(journal: Journal, hashes: list[str]) -> list[str]:
    found: dict[str, str] = {}
    unique = list(dict.fromkeys(hashes))
    for start in range(0, len(unique), 500):
        chunk = unique[start:start + 500]
        found.update(journal.conn.execute(
            f"SELECT hash, body FROM blobs WHERE hash IN ({','.join('?' * len(chunk))})", chunk).fetchall())
    return [found[h] for h in hashes]


def _joined(pieces: list[str]) -> str:
    """A mirror's text from its pieces (the last, its tail, joined without a separator)."""
    separator = _EARLIER_SEPARATOR if pieces[0].startswith(_EARLIER_HEAD) else MIRROR_SEPARATOR
    return separator.join(pieces[:-1]) + pieces[-1]


@dataclass(frozen=True)
class CalibrationInForce:
    """The calibration the session's latest forward for a model was sent under, and what its answer taught."""

    k: float
    samples: int
    learnt: tuple[int, int] | None
    """(estimate, prompt_tokens) when the proxy learnt from that answer: the agent's answer (not a context round)
    to a forward that carried an estimate (not a splice), with a usage."""


def calibration_in_force(journal: Journal, session_id: str, model: str | None) -> CalibrationInForce | None:
    """None when the session has no such forward (or only ones journaled before the sample count was)."""
    return _in_force(journal.conn.execute(_FORCE.format(where="r.session_id = ? AND r.model IS NOT DISTINCT FROM ?"),
                                          [session_id, model]).fetchone())


def latest_calibration(journal: Journal, model: str | None) -> CalibrationInForce | None:
    """The calibration of the latest forward for ``model`` in any session, and what its answer taught: where a new
    session starts, whichever process serves it (replicas share it through the store, not their memory)."""
    return _in_force(journal.conn.execute(_FORCE.format(where="r.model IS NOT DISTINCT FROM ?"), [model]).fetchone())


_FORCE = ("SELECT f.k, f.samples, f.estimate, p.prompt_tokens, p.outcome FROM requests r"
          " JOIN forwards f ON f.request_id = r.id"
          " LEFT JOIN responses p ON p.request_id = f.request_id AND p.attempt = f.attempt"
          " WHERE {where} ORDER BY r.id DESC, f.attempt DESC LIMIT 1")


def _in_force(row: Any) -> CalibrationInForce | None:
    if row is None or row[0] is None or row[1] is None:
        return None
    k, samples, estimate, prompt, outcome = row
    taught = bool(estimate and prompt and estimate > 0 and prompt > 0 and outcome != "context_round")
    return CalibrationInForce(float(k), int(samples), (int(estimate), int(prompt)) if taught else None)
