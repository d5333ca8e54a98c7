"""Where the store probes put their databases: SQLite files in a temporary folder, or fresh databases on a
PostgreSQL 16 the probe starts itself with pgserver (a test dependency)."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Callable, Iterator


@contextlib.contextmanager
def databases(backend: str, prefix: str) -> Iterator[Callable[[str], str]]:
    """`where(name)`: a new SQLite path, or the DSN of a new PostgreSQL database, named `name`. The server (and
    the folder's SQLite files) go when the block ends."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    server = None
    if backend == "postgres":
        import pgserver

        server = pgserver.get_server(folder / "pg", cleanup_mode="stop")

    def where(name: str) -> str:
        return str(folder / f"{name}.db") if server is None else fresh_database(server, name)

    try:
        yield where
    finally:
        if server is not None:
            server.cleanup()
        for f in folder.glob("*.db*"):
            f.unlink()


def fresh_database(server, name: str) -> str:
    import psycopg

    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server.get_uri(name)
