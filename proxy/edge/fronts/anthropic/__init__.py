"""The Anthropic Messages front (``POST /v1/messages``): decode, encode, stream; translated or native upstream."""
