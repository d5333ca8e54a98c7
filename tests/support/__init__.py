"""Helpers for tests and benchmarks; the app never imports these."""
