"""A session's working state, journaled: the offer, the reminder, pending confirmations and the live mirror.

The projection is rebuilt from the decisions; these few values are not derived from anything else, and losing
them (a restart, a session evicted from the proxy's working cache) changed what went upstream: an offer vanished
mid-turn (the tool list changed, the prefix cache broke), a confirmation was never told, the reminder came twice,
a draft of the mirror was overwritten. Each change is one row; the newest row of a session is its state.

The mirror is journaled as what it shows (``MirrorShown``): the hashes of the messages in it, whose bodies the
journal holds already (the forward that sent them stored them), and their identities, two lists delta-encoded on
the session's previous ones; its text is rendered from them when read back. Mirrors journaled before were their
text cut into pieces (its entries, as blobs), or the text whole: both still read back as they were written.

Plain functions over a ``Journal`` (``writer.call(record_session_state, ...)``), so the Journal class stays as is.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ctxproxy.store.cuts import ForwardRecord
from ctxproxy.store.deltas import added_json, runs
from ctxproxy.store.journal import Journal
from ctxproxy.store.reads import chain

__all__ = ["MIRROR_SEPARATOR", "CalibrationInForce", "MirrorShown", "SessionState", "StateChange",
           "calibration_in_force", "latest_calibration", "record_forward_and_state", "record_session_state",
           "session_state"]

MIRROR_SEPARATOR = "\n    },\n    {\n"
"""Where a mirror journaled as pieces (before ``mirror_ids``) was cut: between two of its entries, as
``proxy.tools.mirror.mirror_document`` lays them out; its pieces are joined back with it."""
_EARLIER_SEPARATOR = "\n  },\n  {\n"
"""The separator of the mirrors journaled before their indent became two spaces (issue #13): such a mirror's first
piece begins ``_EARLIER_HEAD``, and its pieces are joined back with this one."""
_EARLIER_HEAD = '{\n "session": '

_MAX_DEPTH = 64
"""A mirror's list is stored whole rather than as the 65th delta of a chain: a read rebuilds at most 64 rows (in
one query)."""


@dataclass(frozen=True)
class MirrorShown:
    """What the mirror last written shows: the hashes of the messages it shows (their bodies are the journal's
    already) and their identities, under its revision. Its text is rendered from them
    (``proxy.tools.mirror.mirror_document``), so the journal keeps no copy of it."""

    revision: int
    ids: tuple[str, ...]
    hashes: tuple[str, ...]
    bodies: Mapping[str, bytes] = field(default_factory=dict, compare=False)
    """Journaled: the bodies of shown messages that no forward stores (an assistant message ``null_content`` filled
    in upstream); read back: the canonical body of every message it shows that the journal has."""


@dataclass(frozen=True)
class SessionState:
    offered_turn: str | None = None
    reminded_turn: str | None = None
    confirmations: tuple[str, ...] = ()
    mirror: str | None = None
    """Where LIVE_CONTEXT.json is written (None: the mirror is off)."""
    mirror_text: str | None = None
    """The mirror as last written, as a journal kept it before ``mirror_shown`` (None once committed or refused)."""
    mirror_shown: MirrorShown | None = None
    """What the mirror last written shows, while a draft of it may be pending (None once committed or refused)."""


def record_session_state(journal: Journal, session_id: str, request_id: int, state: SessionState,
                         created_at: str) -> None:
    """Journal the session's state as it is after ``request_id`` changed it. The mirror is journaled as what it
    shows (``MirrorShown``: two lists, delta-encoded on the session's last ones); a text read back from a journal
    kept before that, and not written again since, as one blob."""
    shown = state.mirror_shown
    with journal.conn:
        lists = (None, None) if shown is None else _record_shown(journal, session_id, shown)
        mirror_hash = None if state.mirror_text is None or shown is not None else _record_text(journal,
                                                                                               state.mirror_text)
        journal.conn.execute(
            "INSERT INTO session_state (session_id, request_id, offered_turn, reminded_turn, confirmations, mirror,"
            " mirror_hash, mirror_list, mirror_ids, mirror_revision, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [session_id, request_id, state.offered_turn, state.reminded_turn, json.dumps(list(state.confirmations)),
             state.mirror, mirror_hash, *lists, None if shown is None else shown.revision, created_at])


class StateChange(NamedTuple):
    """A working state to journal: ``record_session_state``'s arguments after the journal."""

    session_id: str
    request_id: int
    state: SessionState
    created_at: str


def record_forward_and_state(journal: Journal, rec: ForwardRecord, change: StateChange | None) -> int:
    """``Journal.record_forward`` and, when the request changed it, the working state it left, in one transaction:
    one commit and one trip to the writer thread where a forward with new cuts and a grown mirror took two (issue
    #13). The forward goes first: the mirror names the messages it stores. Returns the forward's list."""
    with journal.conn:  # the two calls' own transactions join this one
        list_id = journal.record_forward(rec)
        if change is not None:
            record_session_state(journal, *change)
    return list_id


def session_state(journal: Journal, session_id: str) -> SessionState:
    """The session's latest journaled state (the defaults when nothing was journaled)."""
    row = journal.conn.execute(
        "SELECT s.offered_turn, s.reminded_turn, s.confirmations, s.mirror, b.body, s.mirror_list, s.mirror_ids,"
        " s.mirror_revision FROM session_state s LEFT JOIN blobs b ON b.hash = s.mirror_hash WHERE s.session_id = ?"
        " ORDER BY s.id DESC LIMIT 1", [session_id]).fetchone()
    if row is None:
        return SessionState()
    offered, reminded, confirmations, mirror, text, mirror_list, mirror_ids, revision = row
    shown = None
    if mirror_ids is not None:
        hashes, ids = chain(journal.conn, int(mirror_list))[0], chain(journal.conn, int(mirror_ids))[0]
        shown = MirrorShown(int(revision), tuple(ids), tuple(hashes), _bodies(journal, hashes))
    elif mirror_list is not None:  # a journal kept before mirror_ids: the text, as its pieces
        pieces = chain(journal.conn, int(mirror_list))[0]
        found = _bodies(journal, pieces)
        text = _joined([found[h].decode() for h in pieces])
    return SessionState(offered, reminded, tuple(json.loads(confirmations)), mirror, text, shown)


def _record_shown(journal: Journal, session_id: str, shown: MirrorShown) -> tuple[int, int]:
    """The mirror's hashes and identities as two lists, each delta-encoded on the session's last mirror's (as this
    connection inserted them, else read along their chains); the bodies no forward stores, stored. At 128k, the
    request that turns the mirror on hashed and stored its ~600 entries as pieces, 2.5-5.8 ms (issue #13); its
    two lists take ~0.2."""
    journal.conn.executemany(
        "INSERT INTO blobs (hash, kind, body, chars) VALUES (?, 'message', ?, ?) ON CONFLICT DO NOTHING",
        [(h, b.decode(), len(b)) for h, b in shown.bodies.items()])
    row = journal.conn.execute(_LAST_SHOWN, [session_id]).fetchone()
    last = None if row is None else _last_shown(journal, session_id, int(row[0]), int(row[1]))
    hashes = _insert_list(journal, None if last is None else last.hashes, list(shown.hashes))
    ids = _insert_list(journal, None if last is None else last.ids, list(shown.ids))
    kept = journal.shown_mirrors
    if len(kept) >= _SHOWN_KEPT and session_id not in kept:
        kept.clear()
    kept[session_id] = Shown((*hashes, list(shown.hashes)), (*ids, list(shown.ids)))
    return hashes[0], ids[0]


class Shown(NamedTuple):
    """A session's last mirror lists, as ``Journal.shown_mirrors`` keeps them: each (list, chain depth, items)."""

    hashes: tuple[int, int, list[str]]
    ids: tuple[int, int, list[str]]


_SHOWN_KEPT = 256
"""How many sessions' last mirror lists a journal connection keeps (``Journal.shown_mirrors``, cleared whole when
full): the next version is delta-encoded on them without reading their chains back (0.3-0.6 ms at 128k)."""

_LAST_SHOWN = ("SELECT mirror_list, mirror_ids FROM session_state WHERE session_id = ? AND mirror_ids IS NOT NULL"
               " ORDER BY id DESC LIMIT 1")


def _last_shown(journal: Journal, session_id: str, hashes_id: int, ids_id: int) -> Shown:
    known: Shown | None = journal.shown_mirrors.get(session_id)
    if known is not None and known.hashes[0] == hashes_id and known.ids[0] == ids_id:
        return known
    (hashes, hashes_depth), (ids, ids_depth) = chain(journal.conn, hashes_id), chain(journal.conn, ids_id)
    return Shown((hashes_id, hashes_depth, hashes), (ids_id, ids_depth, ids))


def _insert_list(journal: Journal, base: tuple[int, int, list[str]] | None, items: list[str]) -> tuple[int, int]:
    """``items`` as a list on ``base`` (list, depth, its items): after the start they share, the rest as runs of it
    and new items; whole when there is no base or its chain is ``_MAX_DEPTH`` long. Returns the list and its
    chain's depth."""
    if base is None or base[1] >= _MAX_DEPTH:
        return _insert_mirror_list(journal, None, [], 0, items)
    base_id, depth, before = base
    return _insert_mirror_list(journal, base_id, before, _same_start(before, items), items, depth)


def _same_start(a: list[str], b: list[str]) -> int:
    """How many items ``a`` and ``b`` share from the start: compared in C where one extends the other."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


def _record_text(journal: Journal, text: str) -> str:
    """A mirror's text, whole, as one blob (a session resumed from a journal kept before ``mirror_shown``)."""
    digest = hashlib.sha256(text.encode()).hexdigest()
    journal.conn.execute("INSERT INTO blobs (hash, kind, body, chars) VALUES (?, 'mirror', ?, ?)"
                         " ON CONFLICT DO NOTHING", [digest, text, len(text)])
    return digest


def _insert_mirror_list(journal: Journal, base_id: int | None, base: list[str], same: int, hashes: list[str],
                        depth: int = 0) -> tuple[int, int]:
    """A mirror's list after the first ``same`` items of the previous one (``base_id``, whose items are ``base``
    and whose chain has ``depth`` lists): the rest as runs of ``base`` where they repeat it (an early change keeps
    the later entries) and new items. Returns the list and how many lists its chain has."""
    added = runs(base, hashes[same:])
    if not same and all(isinstance(item, str) for item in added):
        base_id = None
    list_id = journal.conn.insert("INSERT INTO message_lists (base_id, base_len, added, length) VALUES (?, ?, ?, ?)",
                                  [base_id, same, added_json(added), len(hashes)])
    return list_id, 1 if base_id is None else depth + 1


def _bodies(journal: Journal, hashes: list[str]) -> dict[str, bytes]:
    """The blobs of ``hashes`` that the journal has, by hash."""
    found: dict[str, bytes] = {}
    unique = list(dict.fromkeys(hashes))
    for start in range(0, len(unique), 500):
        chunk = unique[start:start + 500]
        found.update((h, body.encode()) for h, body in journal.conn.execute(
            f"SELECT hash, body FROM blobs WHERE hash IN ({','.join('?' * len(chunk))})", chunk).fetchall())
    return found


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
