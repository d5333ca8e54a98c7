"""Agent-harness inference service on Ray Serve and vLLM."""
