"""Serving: an OpenAI-compatible HTTP server, a terminal chat and the conversation cache both resume from."""
