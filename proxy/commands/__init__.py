"""The ``ctxproxy`` command line: serve, sessions, show, doctor, replay, prune."""
