"""Run a peer built on the standard library's ``http.server`` without its delayed-acknowledgement stall.

Why: such a server (ctxkeeper 1.2.0) writes an answer's head and its body in two ``send`` calls on a socket with
Nagle's algorithm on. On a connection kept alive, as agents' clients and ``bench/latency.py`` keep theirs, the
second write waits for the client's delayed ACK: ~40 ms a request on Linux, whatever the proxy does. To measure
what the peer itself costs, put this folder first on its ``PYTHONPATH`` (``--peer "NAME=env PYTHONPATH=bench/nodelay
COMMAND"``): Python imports ``sitecustomize`` at start, and this sets ``TCP_NODELAY`` on every connection the
standard library's socket servers accept. Nothing of ctxproxy imports it.
"""

import socketserver

socketserver.StreamRequestHandler.disable_nagle_algorithm = True
