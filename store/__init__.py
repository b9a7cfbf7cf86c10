"""Persistence for ctxproxy. Every SQL string of the project lives in this package."""

from ctxproxy.store.claims import claim, unclaim
from ctxproxy.store.cuts import ForwardRecord, OverflowBody
from ctxproxy.store.failures import JournalUnavailable, open_journal
from ctxproxy.store.journal import IncomingRequest, Journal, RecordedRequest, ResponseRecord, prefix_digest
from ctxproxy.store.kept_responses import keep_response, kept_response
from ctxproxy.store.locks import LocalLocks, LockUnavailable, SessionLocking, session_locks
from ctxproxy.store.memory import MemoryJournal
from ctxproxy.store.retention import PruneReport
from ctxproxy.store.session_state import (
    CalibrationInForce,
    MirrorShown,
    SessionState,
    StateChange,
    calibration_in_force,
    latest_calibration,
    record_forward_and_state,
    record_session_state,
    session_state,
)
from ctxproxy.store.writer import JournalWriter

__all__ = [
    "CalibrationInForce",
    "ForwardRecord",
    "IncomingRequest", "Journal", "JournalUnavailable", "JournalWriter",
    "LocalLocks", "LockUnavailable",
    "MemoryJournal",
    "MirrorShown",
    "OverflowBody",
    "PruneReport",
    "RecordedRequest",
    "ResponseRecord",
    "SessionLocking",
    "SessionState",
    "StateChange",
    "calibration_in_force",
    "claim",
    "keep_response",
    "kept_response",
    "latest_calibration",
    "open_journal",
    "prefix_digest",
    "record_forward_and_state",
    "record_session_state",
    "session_locks",
    "session_state",
    "unclaim",
]
