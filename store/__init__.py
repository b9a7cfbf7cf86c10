"""Persistence for ctxproxy. Every SQL string of the project lives in this package."""

from store.cuts import ForwardRecord, OverflowBody
from store.journal import IncomingRequest, Journal, RecordedRequest, ResponseRecord, prefix_digest
from store.writer import JournalWriter

__all__ = [
    "ForwardRecord",
    "IncomingRequest", "Journal", "JournalWriter",
    "OverflowBody",
    "RecordedRequest",
    "ResponseRecord",
    "prefix_digest",
]
