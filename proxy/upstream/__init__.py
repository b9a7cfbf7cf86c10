"""Talking to the model server: the endpoint, its transport, its window, its answers and streams."""
