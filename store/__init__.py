"""Persistence for ctxproxy. Every SQL string of the project lives in this package."""

from store.journal import IncomingRequest, Journal, RecordedRequest, ResponseRecord, prefix_digest
from store.writer import JournalWriter

__all__ = ["IncomingRequest", "Journal", "JournalWriter", "RecordedRequest", "ResponseRecord", "prefix_digest"]
