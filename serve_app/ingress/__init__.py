"""HTTP ingress: FastAPI routes per API, auth, body limits, SSE framing, error envelopes."""
