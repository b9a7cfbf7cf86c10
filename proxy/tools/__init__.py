"""The context tools the proxy injects (``ctx``, ``context_note``, ...): schemas, the offer rule, the intents a call
parses into and their pure application to a session's state. No I/O: the runners in ``proxy`` do it.

A regular package (not a namespace one), so that tools that read the import graph (import-linter, in
``make test``) see these modules and hold them to the core's contract.
"""
