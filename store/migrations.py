"""The journal's schema: one ordered list of named steps, applied when a ``Journal`` is opened, on either backend.

The journal is append-only: every table but ``sessions`` only ever receives inserts (the one exception is the
operator's ``ctxproxy prune``, ``store.retention``, which deletes idle sessions whole). A request a crash left
unanswered gets one more ``responses`` row, outcome ``interrupted`` and status 0 (``store.recovery``). Message
bodies and request parameters are content-addressed (stored once, whatever the number of requests that carry
them) and each request's message list is delta-encoded against the session's previous list, so a session of R
rounds costs O(total bytes), not O(R²).

The same steps build a SQLite file and a PostgreSQL database (``store.migrate`` runs them and translates the DDL);
a step may be Python (``m006`` indexes the lists already journaled), run the same on both.
"""

from __future__ import annotations

import json
from collections import OrderedDict

from ctxproxy.store.migrate import Step, ddl
from ctxproxy.store.prefixes import PrefixDigests, index_list
from ctxproxy.store.reads import chain_hashes
from ctxproxy.store.sql import Connection

__all__ = ["STEPS"]

STEPS: list[tuple[str, Step]] = []
"""Every step, in the order they apply (``store.migrate.apply``)."""


def step(fn: Step) -> Step:
    STEPS.append((fn.__name__, fn))
    return fn


@step
def m001_journal(conn: Connection) -> None:
    ddl(conn, """
        -- Content-addressed bodies: one chat message, or the request parameters other than `messages`
        -- (model, tools, sampling fields...). hash = sha256 of the canonical JSON in `body`.
        CREATE TABLE blobs (
            hash TEXT PRIMARY KEY,
            kind TEXT NOT NULL,          -- 'message' | 'params'
            body TEXT NOT NULL,          -- canonical JSON (sorted keys, no spaces)
            chars INTEGER NOT NULL       -- len(body), for reports
        );

        -- A message list, delta-encoded: the first `base_len` hashes of list `base_id`, then `added`.
        -- A list that extends the session's previous one therefore stores only the new hashes.
        CREATE TABLE message_lists (
            id INTEGER PRIMARY KEY,
            base_id INTEGER REFERENCES message_lists(id),
            base_len INTEGER NOT NULL,
            added TEXT NOT NULL,         -- JSON array of blob hashes
            length INTEGER NOT NULL      -- base_len + len(added)
        );

        -- The only mutable rows in the schema: each session's identity and its head (last history seen),
        -- which the next request is checked against to tell a continuation from a fork.
        CREATE TABLE sessions (
            id TEXT PRIMARY KEY,
            fingerprint TEXT,            -- sha256 prefix of the first system + first user message; NULL if named
            named INTEGER NOT NULL,      -- 1 when the client named it (session header)
            parent_id TEXT REFERENCES sessions(id),
            shared_len INTEGER NOT NULL, -- messages shared with the parent when forked
            created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL,
            head_list_id INTEGER REFERENCES message_lists(id),
            head_len INTEGER NOT NULL,
            head_digest TEXT NOT NULL,   -- sha256 over the head's message hashes, joined
            requests INTEGER NOT NULL,
            model TEXT
        );
        CREATE INDEX sessions_by_fingerprint ON sessions(fingerprint);

        -- One row per client request, written before anything is forwarded.
        CREATE TABLE requests (
            id INTEGER PRIMARY KEY,
            session_id TEXT NOT NULL REFERENCES sessions(id),
            received_at TEXT NOT NULL,
            path TEXT NOT NULL,
            model TEXT,
            stream INTEGER NOT NULL,
            list_id INTEGER NOT NULL REFERENCES message_lists(id),
            params_hash TEXT NOT NULL REFERENCES blobs(hash),
            headers TEXT NOT NULL,       -- JSON object; credential headers kept by name only, value never stored
            body_bytes INTEGER NOT NULL
        );
        CREATE INDEX requests_by_session ON requests(session_id, id);

        -- What went upstream for a request: one row per attempt. verbatim = 1 when the client's bytes were
        -- forwarded unchanged.
        CREATE TABLE forwards (
            id INTEGER PRIMARY KEY,
            request_id INTEGER NOT NULL REFERENCES requests(id),
            attempt INTEGER NOT NULL,
            list_id INTEGER NOT NULL REFERENCES message_lists(id),
            params_hash TEXT NOT NULL REFERENCES blobs(hash),
            verbatim INTEGER NOT NULL,
            UNIQUE (request_id, attempt)
        );

        -- The upstream's answer to one attempt (or why there was none), with usage and timings.
        CREATE TABLE responses (
            id INTEGER PRIMARY KEY,
            request_id INTEGER NOT NULL REFERENCES requests(id),
            attempt INTEGER NOT NULL,
            outcome TEXT NOT NULL,       -- ok | upstream_error | unreachable | timeout | client_disconnected
            status INTEGER NOT NULL,     -- HTTP status the client got
            body TEXT,                   -- the answer JSON, or the SSE text of a streamed answer
            prompt_tokens INTEGER,
            completion_tokens INTEGER,
            usage TEXT,                  -- the upstream's `usage` object, JSON
            ttfb_ms REAL,                -- forward to first upstream byte
            total_ms REAL,               -- forward to last byte
            finished_at TEXT NOT NULL,
            UNIQUE (request_id, attempt)
        );
        """
    )


@step
def m002_decisions_and_overflow(conn: Connection) -> None:
    ddl(conn, """
        -- Every decision the projection (or the operator, or the model) made, in order. Re-applied to every request
        -- of the session by message identity; never updated, never deleted (an unpin is a new row).
        CREATE TABLE decisions (
            id INTEGER PRIMARY KEY,
            session_id TEXT NOT NULL REFERENCES sessions(id),
            request_id INTEGER REFERENCES requests(id),  -- the request whose projection made it; NULL if operator
            kind TEXT NOT NULL,          -- spill | elide | fold | pin | unpin
            target TEXT NOT NULL,        -- message identity (tool:<call id>[#n] or <role>:<hash16>[#n])
            message_hash TEXT NOT NULL,  -- the exact message it was made for ('' for pins)
            replacement TEXT NOT NULL,   -- the exact text put in place of the content
            overflow_id TEXT NOT NULL,   -- sha256 of what was removed (its body is in `overflow`)
            until TEXT NOT NULL,         -- fold: identity of the last folded message
            count INTEGER NOT NULL,      -- fold: messages folded
            source TEXT NOT NULL,        -- auto | operator | model
            created_at TEXT NOT NULL
        );
        CREATE INDEX decisions_by_session ON decisions(session_id, id);

        -- What was cut, per session: the body is a content-addressed blob (kind 'overflow'), stored once however
        -- many sessions cut the same bytes; this row scopes it, so read_overflow only serves a session its own.
        CREATE TABLE overflow (
            session_id TEXT NOT NULL REFERENCES sessions(id),
            id TEXT NOT NULL REFERENCES blobs(hash),   -- sha256 of the body
            tool TEXT NOT NULL,
            call_id TEXT NOT NULL,
            bytes INTEGER NOT NULL,
            created_at TEXT NOT NULL,
            PRIMARY KEY (session_id, id)
        );

        -- A forked session inherits its parent's decisions made up to the fork (NULL: none).
        ALTER TABLE sessions ADD COLUMN inherit_upto INTEGER;
        -- The token estimate of what was forwarded and the calibration ratio in force: with the answer's
        -- usage.prompt_tokens, the calibration can be rebuilt after a restart.
        ALTER TABLE forwards ADD COLUMN estimate INTEGER;
        ALTER TABLE forwards ADD COLUMN k REAL;
        """
    )


@step
def m003_context_ops(conn: Connection) -> None:
    ddl(conn, """
        -- Every context-tool call the proxy executed for the model, with what actually happened. The calls and
        -- their results never reach the agent; this is where they are kept.
        CREATE TABLE context_ops (
            id INTEGER PRIMARY KEY,
            session_id TEXT NOT NULL REFERENCES sessions(id),
            request_id INTEGER NOT NULL REFERENCES requests(id),
            round INTEGER NOT NULL,          -- the agent's round in its turn (see docs/api/sse_events.json)
            op TEXT NOT NULL,                -- status | pin | unpin | drop | note | read_overflow
            ok INTEGER NOT NULL,             -- 0 when nothing was applied
            arguments TEXT NOT NULL,         -- the call's arguments as the model sent them
            result TEXT NOT NULL,            -- what the model was told
            handles TEXT NOT NULL,           -- JSON array of the handles acted on
            tokens_freed INTEGER NOT NULL,
            overflow_ids TEXT NOT NULL,      -- JSON array
            created_at TEXT NOT NULL
        );
        CREATE INDEX context_ops_by_session ON context_ops(session_id, id);
        """
    )


@step
def m004_request_turns(conn: Connection) -> None:
    ddl(conn, """
        -- The turn a request belongs to: the hash of the person's latest message in it ('' when none). The
        -- scorecard counts tokens and context ops per turn.
        ALTER TABLE requests ADD COLUMN turn TEXT NOT NULL DEFAULT '';
        CREATE INDEX requests_by_turn ON requests(session_id, turn);
        """
    )


@step
def m005_session_state(conn: Connection) -> None:
    ddl(conn, """
        -- What a session's working state held after a request changed it (the offer, the reminder, the
        -- confirmations not yet told to the model, the live mirror), so a restart or an evicted session resumes
        -- with the same tool list and system lines. Append-only: the newest row of a session is its state.
        CREATE TABLE session_state (
            id INTEGER PRIMARY KEY,
            session_id TEXT NOT NULL REFERENCES sessions(id),
            request_id INTEGER NOT NULL REFERENCES requests(id),  -- the request during which it changed
            offered_turn TEXT,           -- identity of the message opening the turn the context tools are offered in
            reminded_turn TEXT,          -- the turn the soft-ceiling reminder was given in
            confirmations TEXT NOT NULL, -- JSON array: what the context tools did, for the model's next request
                                         -- ([] once told: a confirmation delivered is one no longer pending)
            mirror TEXT,                 -- where LIVE_CONTEXT.json is written; NULL while the mirror is off
            mirror_hash TEXT REFERENCES blobs(hash),  -- the mirror as last written (a blob of kind 'mirror',
                                         -- hash = sha256 of its text): a file that differs is the model's draft,
                                         -- judged against this; NULL once committed or refused
            created_at TEXT NOT NULL
        );
        CREATE INDEX session_state_by_session ON session_state(session_id, id);

        -- The calibration's sample count in force for a forward, beside its `k`: 0 while it is the default,
        -- which the first answer's usage replaces outright (more: averaged in). With the session's latest
        -- forward and its answer, the calibration is rebuilt exactly, whatever session it was seeded from.
        ALTER TABLE forwards ADD COLUMN samples INTEGER;
        """
    )


@step
def m006_prefix_index(conn: Connection) -> None:
    ddl(conn, """
        -- The segment of a request's message list (store.prefixes): the first list of a run of lists each
        -- extending the previous whole, whose prefix digests are kept together. NULL for a forward's list.
        ALTER TABLE message_lists ADD COLUMN segment INTEGER;

        -- The prefix index: the digest (sha256 over the message hashes, joined, as sessions.head_digest) of each
        -- prefix of the lists of a segment, from the first position its first list does not share with its base.
        -- One row per message a request added, so a fork's shared length is found by a few indexed SELECTs.
        CREATE TABLE prefixes (
            segment INTEGER NOT NULL,    -- message_lists.id of the segment's first list
            length INTEGER NOT NULL,     -- the prefix's length in messages
            digest TEXT NOT NULL,
            PRIMARY KEY (segment, length)
        ) WITHOUT ROWID;
        """
    )
    _index_journaled_lists(conn)


def _index_journaled_lists(conn: Connection) -> None:
    """Index every request's list already journaled, oldest first (a base before the lists built on it). A list's
    base is usually the one just indexed, so the last few are kept rebuilt; any other is rebuilt from its chain."""
    rows = conn.execute("SELECT id, base_id, base_len, added FROM message_lists"
                        " WHERE id IN (SELECT list_id FROM requests) ORDER BY id").fetchall()
    recent: OrderedDict[int, list[str]] = OrderedDict()
    for list_id, base_id, base_len, added in rows:
        base = [] if base_id is None else recent.get(base_id) or chain_hashes(conn, base_id)
        hashes = base[:base_len] + json.loads(added)
        index_list(conn, list_id, PrefixDigests(hashes), base_id, base_len)
        recent[list_id] = hashes
        if len(recent) > 16:
            recent.popitem(last=False)


@step
def m007_overflow_spans_and_mirror_lists(conn: Connection) -> None:
    ddl(conn, """
        -- A cut body the journal holds already, named by its place in the cutting request's own message list
        -- rather than stored again: a fold (part 'messages': '[' + the span's message bodies joined by ',' + ']')
        -- or a tool result spilled or elided (part 'content': the one message's content). Before, each fold stored
        -- its whole span again as an overflow blob, and each later fold (which extends the earlier one) the longer
        -- span again: 600 rounds left 59.8 MB of fold blobs for 6.5 MB of history. Rebuilt on read, byte for
        -- byte, whose sha256 is `id`. Bodies cut before keep their overflow row and blob, read as before.
        CREATE TABLE overflow_spans (
            session_id TEXT NOT NULL REFERENCES sessions(id),
            id TEXT NOT NULL,            -- sha256 of the rebuilt body (the id the stub names)
            list_id INTEGER NOT NULL REFERENCES message_lists(id),  -- the cutting request's incoming list
            start INTEGER NOT NULL,      -- the span within that list: [start, start + count)
            count INTEGER NOT NULL,
            part TEXT NOT NULL,          -- 'messages' (a fold) | 'content' (one message's content)
            tool TEXT NOT NULL,
            call_id TEXT NOT NULL,
            bytes INTEGER NOT NULL,      -- length of the rebuilt body
            created_at TEXT NOT NULL,
            PRIMARY KEY (session_id, id)
        );

        -- The live mirror as last written, kept as its pieces (one entry each, mostly: blobs of kind 'mirror'
        -- stored once) in a message list delta-encoded against the session's previous mirror. Stored whole on every
        -- change (`mirror_hash`), it took 57 MB of a 600-round session's journal; rows written before keep that.
        ALTER TABLE session_state ADD COLUMN mirror_list INTEGER REFERENCES message_lists(id);
        """
    )


@step
def m008_kept_responses(conn: Connection) -> None:
    ddl(conn, """
        -- The Responses API's stored responses (``store: true``, its default): a later request naming one in
        -- `previous_response_id` continues from it, so the proxy expands the chain to the whole conversation
        -- before the projection. Insert-only, one row per response ctxproxy produced.
        CREATE TABLE kept_responses (
            id TEXT PRIMARY KEY,          -- the response's id as the client got it (`resp_…`)
            items TEXT NOT NULL,          -- JSON array: the conversation's input items then the response's output
                                          -- items, as the next request in the chain continues from them
            created_at TEXT NOT NULL
        );
        """
    )


@step
def m009_postgres(conn: Connection) -> None:
    """PostgreSQL only (SQLite has both built in): the three JSON functions of SQLite the store's queries use (a
    list's hashes are a JSON array in TEXT), over TEXT, so the queries stay one set; and the count of prunes,
    which tells a replica another process removed rows (``RetentionMixin.data_version``)."""
    if conn.dialect == "postgresql":
        conn.script(_PG_ONLY)


_PG_ONLY = """
CREATE TABLE journal_version (version BIGINT NOT NULL);
INSERT INTO journal_version VALUES (0);
CREATE FUNCTION json_each(text) RETURNS TABLE (value text) LANGUAGE sql IMMUTABLE STRICT
    AS $$ SELECT json_array_elements_text($1::json) $$;
CREATE FUNCTION json_array_length(text) RETURNS integer LANGUAGE sql IMMUTABLE STRICT
    AS $$ SELECT json_array_length($1::json) $$;
-- a '$.key' path only: what the store asks
CREATE FUNCTION json_extract(text, text) RETURNS text LANGUAGE sql IMMUTABLE STRICT
    AS $$ SELECT $1::json ->> substr($2, 3) $$;
"""


@step
def m010_session_claims(conn: Connection) -> None:
    ddl(conn, """
        -- The request that last held the session's lock (store.claims): a process whose memory of the session
        -- was filled while handling another request, of another process, reads the session back. NULL: nobody
        -- since an operator's change (or ever).
        ALTER TABLE sessions ADD COLUMN claimed_by INTEGER;
        """
    )


@step
def m011_postgres_foreign_key_indexes(conn: Connection) -> None:
    """PostgreSQL only: an index on each column that refers to another table's row. PostgreSQL checks a deleted
    row's referrers one row at a time, and without these by a full scan: a prune of 2 050 requests took 2.1 s
    (SQLite's prune checks the keys once, at the end, ``RetentionMixin.prune``). Placement never reads by them."""
    if conn.dialect == "postgresql":
        conn.script(_FOREIGN_KEY_INDEXES)


_FOREIGN_KEY_INDEXES = "\n".join(
    f"CREATE INDEX {table}_by_{column} ON {table}({column});" for table, column in [
        ("message_lists", "base_id"), ("sessions", "parent_id"), ("sessions", "head_list_id"),
        ("requests", "list_id"), ("requests", "params_hash"), ("forwards", "list_id"), ("forwards", "params_hash"),
        ("decisions", "request_id"), ("overflow", "id"), ("overflow_spans", "list_id"),
        ("context_ops", "request_id"), ("session_state", "request_id"), ("session_state", "mirror_hash"),
        ("session_state", "mirror_list")])


@step
def m012_request_instances(conn: Connection) -> None:
    ddl(conn, """
        -- The process that handles the request (store.liveness): on a shared store, a request still unanswered
        -- whose process no longer holds its liveness lock was cut off by that process's death, not in flight.
        -- NULL on SQLite (one process: a restart marks what it left) and for requests journaled before.
        ALTER TABLE requests ADD COLUMN instance TEXT;
        """
    )


@step
def m013_decisions_by_reference_and_list_runs(conn: Connection) -> None:
    ddl(conn, """
        -- A decision whose replacement is the whole content of a message that went upstream (a spill's stub, an
        -- elision's marker, a fold's stub) names that message (a blob of kind 'message', stored with the forward)
        -- instead of holding the text again: `replacement` is '' and the text is the named message's `content`,
        -- read back as it was. A 600-round session kept each stub twice, 1.7 MB of its 15.8 MB at 128k. NULL: the
        -- text is in `replacement` (every decision journaled before, and those made outside a projection).
        ALTER TABLE decisions ADD COLUMN replaced_by TEXT;
        -- A forward's list or a mirror's list (session_state.mirror_list) written from now on may hold, among its
        -- hashes, runs [start, count]: `count` hashes of its base list from position `start` (store.deltas). After
        -- an early change (a fold, an elision) the rest was the base's hashes again, which a prefix-only delta
        -- stored again: 1.6 MB of a 600-round session's lists. No column: `added` is still a JSON array, and one
        -- without runs (every list before, every request's list) reads as before. What reads a forward's or a
        -- mirror's list rebuilds it with store.deltas.rebuild.
        """
    )


@step
def m014_sessions_by_opening(conn: Connection) -> None:
    ddl(conn, """
        -- Placement's reads of an opening's sessions (store.placement), each a search of an index instead of a
        -- visit of every session of the opening (one more with every new run of it): its 8 most recent sessions,
        -- its heads' distinct lengths (one lookup per length), its heads of given digests. The index on the
        -- fingerprint alone is a prefix of each.
        CREATE INDEX sessions_by_opening_recency ON sessions(fingerprint, updated_at, id);
        CREATE INDEX sessions_by_opening_length ON sessions(fingerprint, head_len);
        CREATE INDEX sessions_by_opening_digest ON sessions(fingerprint, head_digest);
        DROP INDEX sessions_by_fingerprint;
        """
    )


@step
def m015_mirrors_as_what_they_show(conn: Connection) -> None:
    ddl(conn, """
        -- A mirror is journaled from now on as what it shows (store.session_state.MirrorShown): `mirror_list` the
        -- hashes of its messages (blobs of kind 'message', stored with the forwards that sent them), `mirror_ids`
        -- a list of their identities (in message_lists, delta-encoded the same way), `mirror_revision` its
        -- revision; its text is rendered from them. Stored as its entries (blobs of kind 'mirror'), the request
        -- that turns the mirror on at 128k hashed and inserted ~600 of them, 2.5-5.8 ms (issue #13). Rows written
        -- before keep `mirror_list` as the pieces of the text, and `mirror_ids` NULL.
        ALTER TABLE session_state ADD COLUMN mirror_ids INTEGER REFERENCES message_lists(id);
        ALTER TABLE session_state ADD COLUMN mirror_revision INTEGER;
        """
    )
    if conn.dialect == "postgresql":  # as m011: a column that refers to another table's row is indexed there
        conn.script("CREATE INDEX session_state_by_mirror_ids ON session_state(mirror_ids);")
