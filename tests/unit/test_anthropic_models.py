"""The Anthropic shape of GET /v1/models (list + paging) and GET /v1/models/{id}."""

from __future__ import annotations

import pytest

from serve_app.errors import ServiceError
from serve_app.ingress.anthropic.models import model_list, model_object
from serve_app.settings import ModelConfig

M = ModelConfig(id="small", aliases=["claude-small"], display_name="Small", max_model_len=32768, max_output_tokens=4096)
N = ModelConfig(id="big", max_model_len=8192, max_output_tokens=2048)
SERVED = [("small", M), ("claude-small", M), ("big", N)]


def test_model_object_fields():
    assert model_object("claude-small", M) == {
        "type": "model", "id": "claude-small", "display_name": "Small", "created_at": M.created_at,
        "max_input_tokens": 32768, "max_tokens": 4096, "lifecycle": "active", "deprecated_at": None,
        "retires_at": None,
    }


def test_model_objects_validate_against_the_installed_sdk_types():
    """The SDK's ModelInfo requires fields (e.g. `lifecycle`) that older objects lacked: validate, not just parse."""
    from anthropic.types import ModelInfo

    for mid, m in SERVED:
        info = ModelInfo.model_validate(model_object(mid, m))
        assert (info.id, info.lifecycle, info.max_tokens) == (mid, "active", m.max_output_tokens)
    assert model_object("big", N)["display_name"] == "big"


def test_list_and_cursor_paging():
    full = model_list(SERVED, {})
    assert [o["id"] for o in full["data"]] == ["small", "claude-small", "big"]
    assert (full["has_more"], full["first_id"], full["last_id"]) == (False, "small", "big")
    p1 = model_list(SERVED, {"limit": "2"})
    assert [o["id"] for o in p1["data"]] == ["small", "claude-small"] and p1["has_more"] is True
    p2 = model_list(SERVED, {"limit": "2", "after_id": p1["last_id"]})
    assert [o["id"] for o in p2["data"]] == ["big"] and p2["has_more"] is False
    back = model_list(SERVED, {"limit": "1", "before_id": "big"})
    assert [o["id"] for o in back["data"]] == ["claude-small"] and back["has_more"] is True
    empty = model_list(SERVED, {"after_id": "big"})
    assert empty == {"data": [], "has_more": False, "first_id": None, "last_id": None}


@pytest.mark.parametrize("params", [{"limit": "0"}, {"limit": "1001"}, {"limit": "x"}, {"after_id": "nope"},
                                    {"before_id": "nope"}])
def test_bad_params_are_400(params):
    with pytest.raises(ServiceError) as e:
        model_list(SERVED, params)
    assert e.value.status == 400
