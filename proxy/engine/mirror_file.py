"""The live mirror's file (``LIVE_CONTEXT.json``): when it is written, and how, in O(what changed).

While the automatic cuts cannot reach the target, the mirror shows the projection, and most requests grow it by
one round: at 128k that is every request of the last 160 of a 600-round run, ~500 KB of mirror each time. The file
is rewritten whole only when an entry it shows changed (an elision pass, a fold, a revision); a request that only
adds entries writes them over the closing brackets, in place. A draft of the model's is noticed by the file's size
and times changing, then told apart from a touch by comparing its text with what was written (no hash of the
whole text on every write). After a restart, what was written is rendered from the journal, which keeps what the
mirror shows, not its text (``store.session_state``): a file is compared with that as JSON. Opened for writing, a
file is first truncated, which frees its pages for the write to fault back in: 0.86 ms a whole write against 0.52
in place (issue #13). The mirror is bytes from its entries to the file (``proxy.tools.mirror``): nothing is encoded
on the way out.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ctxproxy.config import Settings
from ctxproxy.proxy.core import Projection, canonical_json
from ctxproxy.proxy.engine.context import SessionContext
from ctxproxy.proxy.tools.mirror import (
    CLOSE,
    appended_document,
    cache_entries,
    mirror_document,
    mirror_path,
    same_mirror,
)
from ctxproxy.store import MirrorShown

__all__ = ["PRIMED_ENTRIES", "MirrorWrite", "keep_unsent", "mirror_due", "rewrite_in_place"]

log = logging.getLogger("ctxproxy")


MirrorWrite = Callable[[], None]
"""The file's new bytes rendered and written: what ``mirror_due`` leaves to run while the request is upstream."""


def mirror_due(ctx: SessionContext, settings: Settings, session_id: str,
               p: Projection) -> tuple[Path | None, MirrorWrite | None]:
    """When the automatic cuts could not reach the target, the projection is written where the model can edit it;
    the mirror stays on until the context is back under the target. Only while it is of use: the context tools
    are enabled (``ctx commit`` is the only way an edit is applied). Written only when what it shows changed, and
    then only what changed when it just grew; a draft of the model's is never overwritten.

    Returns the mirror's path (told to the model) and the write still to do, if any. What the mirror shows is
    decided here (and journaled with the forward); its bytes are rendered and written by the write, which the
    forwarder runs while the request is upstream and waits for before any byte of the answer goes back: the
    model reads the file only once it has answered (``proxy.engine.forward``). Behind a model the write is hidden
    by the model's own time; started before the forward went, it held the GIL the forward needed (a fork after
    600 rounds at 128k, behind an upstream that takes 13 ms: 5.4 ms added in the one run of such a tree). A
    forward the journal refuses leaves it to the next request."""
    above = p.report.scaled > p.report.target
    if not settings.tools_enabled:
        return None, None
    if (p.report.elided or p.report.folded) and above:
        ctx.mirror = ctx.mirror or mirror_path(settings, session_id)
    if ctx.mirror is None and above:
        _prime_entries(ctx, p)
    if ctx.mirror is None or not above:
        return None, None
    path, stat = ctx.mirror, _stat(ctx.mirror)
    if _draft_pending(ctx, path, stat):
        return path, None  # the model is editing it: its draft waits for ctx commit
    ids = [mid for mid, out in zip(p.state.ids, p.state.out, strict=True) if out is not None]
    key = (session_id, ctx.mirror_revision, tuple(ids), tuple(p.hashes[: len(ids)]))
    if key == ctx.mirror_key and ctx.mirror_written and ctx.mirror_stat == stat:
        return path, None  # what it shows has not changed, nor has the file
    kept = _kept_entries(ctx, key, stat)
    ctx.mirror_written = True  # journaled as shown with the forward; ``mirror_key`` once the file has it
    ctx.mirror_shown = MirrorShown(ctx.mirror_revision, key[2], key[3])
    return path, functools.partial(_write, ctx, path, key, p.messages[: len(ids)], kept, stat)


PRIMED_ENTRIES = 64
"""Entries the mirror would show rendered ahead per request (``_prime_entries``): ~0.1 ms."""


def _prime_entries(ctx: SessionContext, p: Projection) -> None:
    """While the projection is over its target and the mirror is off, the entries it would show are rendered
    ahead, ``PRIMED_ENTRIES`` a request, into the cache its first version is joined from, and so are the entries of
    the results whose markers the projection counted ahead (``State.marked_ahead``), as the next elision will show
    them. That version is written whole by the pass that turns the mirror on, an elision or fold pass already the
    slowest of its neighbours: rendering ~630 entries there took 1.6 ms in process at 128k, the slowest request of
    a 600-round run, and its 312 elisions left half of them new, 0.35 ms of its render (issue #13). The cache is
    started afresh when it holds three times what the projection has (its entries, and a marked one for most)."""
    state, k = p.state, ctx.mirror_primed
    if k > len(state.ids) or len(ctx.mirror_entries) > 3 * len(state.ids):
        ctx.mirror_entries.clear()
        k = 0
    chosen = [(state.ids[i], out, state.out_hashes[i]) for i in range(k, min(k + PRIMED_ENTRIES, len(state.ids)))
              if (out := state.out[i]) is not None]
    chosen += [(state.ids[i], marked, marked_hash) for i, marked, marked_hash in state.marked_ahead]
    cache_entries(ctx.mirror_entries, [c[0] for c in chosen], [c[1] for c in chosen], [c[2] for c in chosen])
    ctx.mirror_primed = min(k + PRIMED_ENTRIES, len(state.ids))


def _write(ctx: SessionContext, path: Path, key: tuple[Any, ...], messages: Sequence[dict[str, Any]], kept: int,
           stat: tuple[int, int, int, int] | None) -> None:
    """The mirror's bytes rendered (its new entries only, when it just grew) and written. A file that cannot be
    written is logged and left for the next request to write whole: the answer is not lost for it."""
    session_id, revision, ids, hashes = key
    try:
        if kept and ctx.mirror_document is not None and stat is not None:
            tail = appended_document(ctx.mirror_document, ids[kept:], messages[kept:], hashes[kept:],
                                     ctx.mirror_entries)
            _write_at(path, stat[1] - len(CLOSE), tail)
        else:
            document = mirror_document(session_id, revision, ids, messages, hashes, ctx.mirror_entries)
            ctx.mirror_document = document
            rewrite_in_place(path, document)
    except OSError as exc:
        log.error("could not write the live mirror %s, left for the next request: %s", path, exc)
        ctx.mirror_written, ctx.mirror_key, ctx.mirror_document = False, None, None
        return
    ctx.mirror_key, ctx.mirror_exact, ctx.mirror_stat = key, True, _stat(path)


def keep_unsent(ctx: SessionContext, p: Projection, sent: Sequence[str]) -> None:
    """The mirror just written is journaled as the hashes of the messages it shows, whose bodies the forward
    stores, as they went upstream (``sent``): one that went otherwise (``null_content`` filled in) has its body
    journaled with the mirror."""
    shown = ctx.mirror_shown
    if shown is None or shown is ctx.journaled.mirror_shown or tuple(sent[: len(shown.hashes)]) == shown.hashes:
        return
    ctx.mirror_shown = replace(shown, bodies={h: canonical_json(m) for h, went, m in zip(
        shown.hashes, sent, p.messages, strict=False) if h != went})


def _kept_entries(ctx: SessionContext, key: tuple[Any, ...], stat: tuple[int, int, int, int] | None) -> int:
    """How many entries of the file the new version keeps as they are, when all it does is add entries after them
    (same session and revision, the file as the proxy left it); 0 when it is to be written whole."""
    last = ctx.mirror_key
    if last is None or not ctx.mirror_written or stat is None or stat != ctx.mirror_stat or last[:2] != key[:2]:
        return 0
    n = len(last[2])
    if n == 0 or n >= len(key[2]) or key[2][:n] != last[2] or key[3][:n] != last[3]:
        return 0
    return n


def _draft_pending(ctx: SessionContext, path: Path, stat: tuple[int, int, int, int] | None) -> bool:
    """Does the file (whose ``_stat`` is ``stat``) hold a draft of the model's, which differs from what was last
    written? Read only when its size or times changed since the proxy wrote it (or the proxy restarted since)."""
    if not ctx.mirror_written:
        return False
    if stat is None:
        return False
    if stat == ctx.mirror_stat:
        return False
    data = bytearray(path.read_bytes())
    if data != ctx.mirror_document and (ctx.mirror_exact or not same_mirror(data, ctx.mirror_document or b"")):
        return True
    ctx.mirror_document, ctx.mirror_exact, ctx.mirror_stat = data, True, stat  # touched, not changed
    return False


def _stat(path: Path) -> tuple[int, int, int, int] | None:
    """What tells a file rewritten by someone else: its inode, size, modification and change times; None when
    there is no file to see (a folder of its path missing, or not a folder)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def rewrite_in_place(path: Path, data: bytes | bytearray) -> None:
    """``path`` holds exactly ``data`` after: written over what it held, the rest cut off (or created, with its
    folder)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        _write_all(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def _write_at(path: Path, offset: int, tail: bytes) -> None:
    """The file's bytes from ``offset`` on replaced by ``tail``, the rest cut off."""
    fd = os.open(path, os.O_WRONLY)
    try:
        _write_all(fd, tail, offset)
        os.ftruncate(fd, offset + len(tail))
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | bytearray, offset: int) -> None:
    """All of ``data`` at ``offset`` (``os.pwrite`` may write less than it was given)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
