"""Pure policy beside the turn engine: when the context tools are offered, what the model is told, what is sent.

No I/O and no session object: plain values in, plain values out, so each rule is tested on its own
(``tests/test_policy.py``). ``proxy.engine.planning`` gathers the values (settings, the session's working context, the
projection), calls these, and performs what they decide (it alone updates the session and journals).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctxproxy.proxy.core import Decision, message_hash
from ctxproxy.proxy.core.decisions import CUTS
from ctxproxy.proxy.tools.blocks import NOTE, RESTORE_NOTE
from ctxproxy.proxy.tools.mirror import PARAGRAPH
from ctxproxy.proxy.tools.offer import REMINDER, with_context_tools
from ctxproxy.proxy.tools.schemas import CONTEXT_TOOLS, READ_TOOL

__all__ = [
    "COMPACT", "Payload", "assemble", "confirmation_notice", "guidance", "listed_tools", "offer_due",
    "reminder_due", "reminder_notice", "restorable",
]

Message = dict[str, Any]
COMPACT = ("[ctxproxy] The person asked you to compact your context (/compact). Use your context tools now: "
           "context_status shows what takes the room; context_drop and context_note cut what you no longer need "
           "(everything stays restorable). Write your decisions in a note before you cut. Then answer with one "
           "short line.")


def offer_due(held: bool, usage: float, offer_pct: float, asked: bool, round_: int, offer_round: int) -> bool:
    """The offer rule (DESIGN §5): the tools are offered once the context's share of the budget (``usage``)
    reaches ``offer_pct``, the person asks for them, or the agent's turn reaches ``offer_round`` (0: never by
    rounds); and an offer, once made, holds for the rest of the turn (``held``), so the tool list, and with it
    the upstream's prefix cache, does not change within a turn."""
    return held or usage >= offer_pct or asked or bool(offer_round and round_ >= offer_round)


def reminder_due(offered: bool, scaled: int, soft_ceiling_pct: float, budget: int, reminded_turn: str | None,
                 offered_turn: str | None) -> bool:
    """The soft-ceiling reminder: once per turn in which the tools are offered, when the context nears the budget."""
    return offered and scaled >= soft_ceiling_pct * budget and reminded_turn != offered_turn


def confirmation_notice(confirmations: Sequence[str]) -> Message:
    """What the model's context tools did since its last request, as one system line."""
    return {"role": "system", "content": "[ctxproxy] Applied since your last request: " + " ".join(confirmations)}


def reminder_notice() -> Message:
    return {"role": "system", "content": REMINDER}


def guidance(fenced: bool, offered: bool, restorable: bool, compact: str | None, mirror: Path | None) -> list[Message]:
    """System lines after the projection: the fenced call syntax (all the tools, or only the way back), the
    /compact request, the mirror paragraph."""
    lines = [NOTE if offered else RESTORE_NOTE] if fenced and (offered or restorable) else []
    if compact is not None:
        lines.append(COMPACT + (f" The person adds: {compact}" if compact else ""))
    if mirror is not None:
        lines.append(PARAGRAPH.format(path=mirror))
    return [{"role": "system", "content": line} for line in lines]


def restorable(decisions: Sequence[Decision], new: Sequence[Decision]) -> bool:
    """Whether the session has ever cut anything: from its first stub on, ``read_overflow`` is listed on every
    request (native: in the tool list, byte-identical from then on; fenced: named in a note), so no stub points
    at a tool the model does not have. Decided from the journaled decisions, so a restart lists it the same."""
    return any(d.kind in CUTS or d.kind == "fold" for d in (*decisions, *new))


def listed_tools(offered: bool, restorable: bool, may_offer: bool) -> tuple[dict[str, Any], ...]:
    """The proxy's tools in this request: all of them when offered, else the way back once anything was cut."""
    return CONTEXT_TOOLS if offered else (READ_TOOL,) if restorable and may_offer else ()


@dataclass(frozen=True)
class Payload:
    """The request that goes upstream, and whether it differs from the client's."""

    body: dict[str, Any]
    sent: list[Message]
    hashes: list[str]
    changed: bool


def assemble(body: dict[str, Any], projected: list[Message], hashes: Sequence[str], projection_changed: bool,
             after: list[Message], listed: tuple[dict[str, Any], ...], fenced: bool, fill_null: bool) -> Payload:
    """The projected messages, then the proxy's own (guidance, notices, a follow-up's splice); the proxy's tools
    after the agent's (native route only: the fenced route names them in a note); ``content: null`` filled in
    for upstreams that refuse it."""
    sent = projected + after
    payload: dict[str, Any] = {**body, "messages": sent}
    if listed and not fenced:
        payload["tools"] = with_context_tools(body.get("tools"), listed)
    all_hashes = list(hashes) + [message_hash(m) for m in after]
    filled = fill_null and _fill_null_content(sent, all_hashes)
    changed = projection_changed or bool(after) or bool(listed) or filled
    return Payload(payload, sent, all_hashes, changed)


def _fill_null_content(sent: list[Message], hashes: list[str]) -> bool:
    """Give assistant messages without content ``""`` in place (and their new hashes), for upstreams that refuse
    ``null``; whether any changed. The client's own messages are copies here: projection never shares them."""
    filled = False
    for i, m in enumerate(sent):
        if m.get("role") == "assistant" and m.get("content") is None:
            sent[i] = {**m, "content": ""}
            hashes[i] = message_hash(sent[i])
            filled = True
    return filled
