"""Fronts: the protocols other than OpenAI chat completions that agents speak to ctxproxy
(``proxy.edge.fronts.codec``)."""
