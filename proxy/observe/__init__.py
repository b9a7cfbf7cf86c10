"""What operators see while the proxy runs: Prometheus metrics and the ``context_op`` event stream."""
