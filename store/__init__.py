"""Persistence for ctxproxy. Every SQL string of the project lives in this package."""

from store.cuts import ForwardRecord, OverflowBody
from store.journal import IncomingRequest, Journal, RecordedRequest, ResponseRecord, prefix_digest
from store.memory import MemoryJournal
from store.writer import JournalWriter

__all__ = [
    "ForwardRecord",
    "IncomingRequest", "Journal", "JournalWriter",
    "MemoryJournal",
    "OverflowBody",
    "RecordedRequest",
    "ResponseRecord",
    "prefix_digest",
]
