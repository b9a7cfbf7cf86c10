"""``POST /v1/responses``: the OpenAI Responses API in front of a chat-completions upstream (translated mode).

``decode`` turns a Responses request into the internal chat body, ``encode`` a chat completion into a Response
object, ``events`` a chat SSE stream into Responses events; ``route`` is the HTTP edge that wires them to the
engine. The codec modules are pure (no I/O); the route owns the journal's stored responses (``previous_response_id``).
"""
