"""A real PostgreSQL server for tests: pgserver's PostgreSQL 16 binaries on a data directory of the test session,
listening on a Unix socket only. Each test that needs an empty database gets a fresh one (`fresh_database`)."""

from __future__ import annotations

import itertools
from pathlib import Path

import psycopg

_names = itertools.count()


def start(data_dir: Path):
    """Start a server on `data_dir` (created empty); `.cleanup()` stops it."""
    import pgserver

    return pgserver.get_server(data_dir, cleanup_mode="stop")


def fresh_database(server, prefix: str = "t") -> str:
    """The DSN of a new, empty database on `server`."""
    name = f"{prefix}_{next(_names)}"
    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server.get_uri(name)
