"""Test-only vLLM logits processor that makes the real engine say an exact script.

Integration tests must check parsing and protocols through the whole server with the real engine, yet a small
model will not emit a given tool call on request. A request carrying `SamplingParams.extra_args
["forced_token_ids"]` has every logit masked except the next scripted token; after the script, only
`forced_eos_id` (the model's end-of-turn token) is allowed. Requests without a script are untouched.
Loaded only when the app's `testing.forced_scripts` setting is on.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

SCRIPT_KEY = "forced_token_ids"
EOS_KEY = "forced_eos_id"


class ForcedScriptLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (script token ids, eos id, the request's live output token list)
        self._rows: dict[int, tuple[list[int], int, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, _prompt_ids, output_ids in batch_update.added:
            extra = (params.extra_args or {}) if params is not None else {}
            script = extra.get(SCRIPT_KEY)
            if script is not None:
                self._rows[index] = (list(script), int(extra.get(EOS_KEY, -1)), output_ids)
            else:
                self._rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            ra, rb = self._rows.pop(a, None), self._rows.pop(b, None)
            if ra is not None:
                self._rows[b] = ra
            if direction == MoveDirectionality.SWAP and rb is not None:
                self._rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (script, eos, output_ids) in self._rows.items():
            pos = len(output_ids)
            target = script[pos] if pos < len(script) else eos
            if target < 0:
                continue
            keep = logits[row, target].clone()
            logits[row].fill_(float("-inf"))
            logits[row, target] = torch.maximum(keep, torch.zeros_like(keep))
        return logits
