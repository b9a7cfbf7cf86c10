"""Fronts for protocols other than OpenAI chat completions: each decodes its client's request into the internal
chat-shaped body, lets the same engine (journal, sessions, budget, projection, context tools) serve it, and
encodes the answer back into its own protocol."""
