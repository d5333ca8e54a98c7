"""The test-only forcing logits processor: only the next scripted token survives; rows move with the batch."""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from serve_app.engine.forcing import ForcedScriptLogitsProcessor


def params(script=None, eos=9):
    extra = {"forced_token_ids": script, "forced_eos_id": eos} if script is not None else None
    return SamplingParams(extra_args=extra)


def argmax_rows(proc, logits):
    return proc.apply(logits.clone()).argmax(dim=1).tolist()


def test_forces_script_then_eos_and_leaves_other_rows_alone():
    proc = ForcedScriptLogitsProcessor(None, torch.device("cpu"), False)
    out_a: list[int] = []
    out_b: list[int] = []
    proc.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                  added=[(0, params([3, 5]), [1], out_a), (1, params(None), [1], out_b)]))
    logits = torch.zeros(2, 10)
    logits[:, 7] = 100.0  # what the model "wants"
    assert argmax_rows(proc, logits) == [3, 7]
    out_a.append(3)
    assert argmax_rows(proc, logits) == [5, 7]
    out_a.append(5)
    assert argmax_rows(proc, logits) == [9, 7]  # after the script: end of turn
    masked = proc.apply(logits.clone())
    assert torch.isinf(masked[0]).sum() == 9  # every other token of the forced row is impossible


def test_rows_follow_moves_swaps_and_removals():
    proc = ForcedScriptLogitsProcessor(None, torch.device("cpu"), False)
    a, b = [], []
    proc.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                  added=[(0, params([4]), [1], a), (1, params([6]), [1], b)]))
    proc.update_state(BatchUpdate(batch_size=2, removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)]))
    assert argmax_rows(proc, torch.zeros(2, 10)) == [6, 4]
    proc.update_state(BatchUpdate(batch_size=1, removed=[1], added=[], moved=[(0, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    logits = torch.zeros(2, 10)
    logits[:, 2] = 1.0
    assert argmax_rows(proc, logits) == [2, 6]  # row 0 is free again; the request that was at 0 now sits at 1


def test_unforced_request_replacing_a_forced_row_is_free():
    proc = ForcedScriptLogitsProcessor(None, torch.device("cpu"), False)
    proc.update_state(BatchUpdate(batch_size=1, removed=[], moved=[], added=[(0, params([4]), [1], [])]))
    proc.update_state(BatchUpdate(batch_size=1, removed=[], moved=[], added=[(0, params(None), [1], [])]))
    logits = torch.zeros(1, 10)
    logits[0, 8] = 5.0
    assert argmax_rows(proc, logits) == [8]
