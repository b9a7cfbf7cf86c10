"""Recognising an upstream's "prompt too long" answer, and what it says about the prompt and the window."""

from __future__ import annotations

import json

import pytest

from ctxproxy.proxy.upstream.overflow import detect_overflow


@pytest.mark.parametrize(("status", "body", "tokens", "limit"), [
    (400, {"error": {"code": 400, "type": "exceed_context_size_error", "message": "the request exceeds the "
                     "available context size", "n_prompt_tokens": 6047, "n_ctx": 4096}}, 6047, 4096),
    (400, {"error": {"code": "context_length_exceeded", "type": "invalid_request_error", "message": "This model's "
                     "maximum context length is 4096 tokens. However, you requested 6047 tokens (5047 in the "
                     "messages, 1000 in the completion)."}}, 5047, 4096),
    (400, {"object": "error", "message": "This model's maximum context length is 32768 tokens. However, your request "
           "has 40000 input tokens. Please reduce the length of the input messages."}, 40000, 32768),
    (400, {"error": {"message": "This model's maximum context length is 8192 tokens. However, your messages resulted"
                     " in 9000 tokens."}}, 9000, 8192),
])
def test_an_overflow_is_recognised_with_its_numbers(status: int, body: object, tokens: int, limit: int) -> None:
    overflow = detect_overflow(status, json.dumps(body).encode())
    assert overflow is not None and (overflow.prompt_tokens, overflow.limit) == (tokens, limit)


@pytest.mark.parametrize(("status", "body"), [
    (500, {"error": {"message": "CUDA out of memory; too many tokens in flight"}}),
    (400, {"error": {"message": "Invalid value for 'temperature'"}}),
    (404, {"error": {"message": "model not found; context window unknown"}}),
    (200, {"choices": []}),
])
def test_other_errors_are_not_overflows(status: int, body: object) -> None:
    assert detect_overflow(status, json.dumps(body).encode()) is None
