"""An engine client for tests of everything but the engine: it streams a set text (`script`) in random pieces
(`split_seed`), ending with `finish`, the way an engine's deltas reach the service. The real engine path is the
integration tests'."""

from __future__ import annotations

import random

from serve_app.engine.types import EngineChunk
from serve_app.routing.types import Decision


class ScriptedEngines:
    def __init__(self, script: str = "", finish: str = "stop"):
        self.script, self.finish, self.split_seed = script, finish, 0

    async def block_size(self, key):
        return 16

    async def reasoning_gate(self, key):
        return False

    async def choose(self, key, req):
        return Decision("local", "in-process")

    def prefilled(self, *args, **kwargs):
        pass

    def release(self, *args, **kwargs):
        pass

    def settle(self, *args, **kwargs):
        pass

    async def open(self, key, req):
        text, rng, finish = self.script, random.Random(self.split_seed), self.finish
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""]

        async def chunks():
            for i, piece in enumerate(pieces):
                yield EngineChunk(piece, [1] * max(1, len(piece) // 4),
                                  finish_reason=finish if i == len(pieces) - 1 else None,
                                  num_cached_tokens=0 if i == 0 else None)

        return chunks()
