"""ctxproxy: an OpenAI-compatible reverse proxy that keeps a long agent run inside its context window."""

__version__ = "0.1.0"
