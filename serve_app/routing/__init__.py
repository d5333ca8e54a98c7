"""Choosing the engine replica for each request: block hashing, KV index, policies, the Router deployment."""
