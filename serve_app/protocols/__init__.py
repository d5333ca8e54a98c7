"""Wire models (pydantic) of each API."""
