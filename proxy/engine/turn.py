"""The turn engine: what to do next in one client request, decided without I/O.

A client request may take several round trips upstream: while the model answers with calls to the proxy's
context tools only, the proxy runs them, splices the calls and their results after the conversation and asks
again (the last round without the tools). ``Turn`` decides that, and nothing else: events go in (the upstream
answered, the tools ran, a follow-up was refused), commands come out (forward, run the tools, journal the round,
reply, end early). It holds no socket, clock or journal; one async driver (``proxy.engine.driver``) performs the
commands for both the buffered and the streamed answer. This is mitmproxy's sans-I/O layer in miniature
(``mitmproxy/proxy/commands.py``): calls return immediately, and a playbook test feeds events and reads commands
(``tests/test_turn.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ctxproxy.proxy.tools.blocks import results_message

__all__ = [
    "Answered", "Command", "EndEarly", "Event", "Failed", "Forward", "RecordRound", "Refused", "Reply", "RunTools",
    "Start", "ToolsRan", "Turn",
]

Message = dict[str, Any]


@dataclass(frozen=True)
class Start:
    """Event: the request was admitted and its session locked."""


@dataclass(frozen=True)
class Answered:
    """Event: the upstream answered; ``calls`` are the context-tool calls taken out of it."""

    calls: tuple[Message, ...] = ()
    acts: bool = False
    """The answer also does something for the agent (its own tool calls; a fenced command): it goes to the agent."""
    text: str | None = None
    """What the model said, as it is spliced back before the results of its calls."""
    fenced: bool = False
    """The calls came as ``context`` blocks in the text (the results go back as one user message)."""


@dataclass(frozen=True)
class Failed:
    """Event: the upstream answered with an error: the agent gets it as it came."""


@dataclass(frozen=True)
class ToolsRan:
    """Event: the context tools ran; their tool messages, in call order."""

    results: tuple[Message, ...]


@dataclass(frozen=True)
class Refused:
    """Event: a follow-up round could not be had (too long, an upstream error): the agent keeps what it has."""


Event = Start | Answered | Failed | ToolsRan | Refused


@dataclass(frozen=True)
class Forward:
    """Command: send the conversation upstream, with ``splice`` after it; ``offer``: with the context tools."""

    splice: tuple[Message, ...] = ()
    offer: bool = True


@dataclass(frozen=True)
class RunTools:
    """Command: execute these context-tool calls in order, then send ``ToolsRan``."""

    calls: tuple[Message, ...]


@dataclass(frozen=True)
class RecordRound:
    """Command: journal the answer that only called context tools (the agent never gets it)."""

    rounds: int
    """The internal rounds so far, this one included."""


@dataclass(frozen=True)
class Reply:
    """Command: give the agent the latest answer; ``took_calls``: without the context calls taken out of it."""

    took_calls: bool = False
    acts: bool = False


@dataclass(frozen=True)
class EndEarly:
    """Command: the follow-up failed; end with the previous answer (without its context calls)."""


Command = Forward | RunTools | RecordRound | Reply | EndEarly


@dataclass
class Turn:
    """One client request's rounds: ``handle`` an event, get the commands to perform in order."""

    rounds: int
    """How many follow-ups the proxy may ask for (``max_context_rounds``)."""
    internal: int = 0
    """The internal rounds done so far (answers the agent never got)."""
    splice: list[Message] = field(default_factory=list)
    _answer: Answered | None = None

    def handle(self, event: Event) -> list[Command]:
        if isinstance(event, Start):
            return [self._forward()]
        if isinstance(event, Answered):
            return self._answered(event)
        if isinstance(event, ToolsRan):
            return self._ran(event)
        if isinstance(event, Refused):
            return [EndEarly()]
        return [Reply()]

    def _forward(self) -> Forward:
        return Forward(tuple(self.splice), offer=self.internal < self.rounds)

    def _answered(self, answer: Answered) -> list[Command]:
        if not answer.calls:
            return [Reply()]
        self._answer = answer
        return [RunTools(answer.calls)]

    def _ran(self, ran: ToolsRan) -> list[Command]:
        answer = self._answer
        assert answer is not None, "ToolsRan before RunTools"
        if answer.acts or self.internal == self.rounds:
            return [Reply(took_calls=True, acts=answer.acts)]
        self.internal += 1
        self.splice += _spliced(answer, list(ran.results))
        return [RecordRound(self.internal), self._forward()]


def _spliced(answer: Answered, results: list[Message]) -> list[Message]:
    """The model's calls and their results, as the next round's upstream reads them."""
    if answer.fenced:
        return [{"role": "assistant", "content": answer.text}, results_message(results)]
    return [{"role": "assistant", "content": answer.text, "tool_calls": list(answer.calls)}, *results]
