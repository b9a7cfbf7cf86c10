"""The pure core: message identities today, the projection (spill, elision, pins) next. No I/O, clock or SQL."""

from proxy.rewrite.identity import canonical_json, content_hash, fingerprint, message_hash

__all__ = ["canonical_json", "content_hash", "fingerprint", "message_hash"]
