"""Anthropic Messages API adapter: wire → IR (convert), events → SSE/JSON (encode), routes."""
