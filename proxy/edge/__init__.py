"""The HTTP edge: routes, admission and validation of a request, who is calling, the operator API, serving."""
