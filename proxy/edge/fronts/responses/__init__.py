"""``POST /v1/responses``: the OpenAI Responses API, a front on the codec seam (``proxy.edge.fronts.codec``).

``decode`` turns a Responses request into the internal chat body, ``encode`` a chat completion into a Response
object, ``events`` a chat SSE stream into Responses events (all pure); ``native`` speaks the Responses API to an
upstream that has it; ``front`` wires them to the engine and keeps the responses ``previous_response_id`` names;
``spoken`` turns a chat conversation into Responses requests, for replays.
"""
