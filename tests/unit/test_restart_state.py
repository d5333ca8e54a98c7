"""State that survives a restart: the server key ring (config or environment, rotation) and the Responses store
(SQLite and PostgreSQL; the stores' own behaviour table is tests/unit/test_response_stores.py). "A restart" here is
what the app does on start: the key ring loaded again from the same configuration and the store opened again on
the same file or database, behind fresh ingress apps (the real routes; a stand-in service)."""

from __future__ import annotations

import inspect
import logging
import pickle

import anthropic
import httpx
import httpx2
import openai
import pytest

from serve_app import keyring
from serve_app.ingress.anthropic import signatures
from serve_app.ingress.context import IngressContext
from serve_app.ingress.responses.reasoning_crypto import ReasoningSealer
from serve_app.ingress.responses.store import StoreClient
from serve_app.ingress.responses.postgres_store import PostgresResponseStore
from serve_app.ingress.responses.sqlite_store import SqliteResponseStore
from serve_app.ingress.server import create_app
from serve_app.settings import AppSettings
from serve_app.errors import InvalidRequest
from tests.support.postgres import fresh_database
from test_responses_routes import StubService as ResponsesStub


# -- the key ring ----------------------------------------------------------------------------------------------


def test_ring_from_config_or_environment_newest_first():
    assert keyring.load("one").keys == (b"one",)
    assert keyring.load(["new", "old"]).keys == (b"new", b"old")
    ring = keyring.load(None, environ={keyring.ENV: "new, old"})
    assert ring.keys == (b"new", b"old") and bytes(ring) == b"new"
    assert keyring.load("cfg", environ={keyring.ENV: "env"}).keys == (b"cfg",)  # config wins


def test_unset_secret_is_random_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="serve_app.keyring"):
        a = keyring.load(None, environ={})
    assert "server_secret is not set" in caplog.text and len(bytes(a)) == 64
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="serve_app.keyring"):
        b = keyring.load(None, environ={}, warn=False)
    assert caplog.text == "" and bytes(a) != bytes(b)


def test_ring_crosses_process_boundaries_whole_and_never_prints_keys():
    ring = keyring.load(["new", "old"])
    back = pickle.loads(pickle.dumps(ring))
    assert isinstance(back, keyring.KeyRing) and back.keys == ring.keys
    assert "new" not in repr(ring)


def test_rotation_signatures_and_sealed_reasoning():
    old = keyring.load(["k-old"])
    sig = signatures.sign(old, "thinking")
    sealed = ReasoningSealer(old).seal("reasoning")
    rotated = keyring.load(["k-new", "k-old"])
    assert signatures.verify(rotated, "thinking", sig)
    assert ReasoningSealer(rotated).open(sealed) == "reasoning"
    # New ones are made with the newest key: they verify once the old key is retired.
    new_sig = signatures.sign(rotated, "thinking")
    new_sealed = ReasoningSealer(rotated).seal("reasoning")
    retired = keyring.load(["k-new"])
    assert signatures.verify(retired, "thinking", new_sig) and ReasoningSealer(retired).open(new_sealed)
    assert not signatures.verify(retired, "thinking", sig)
    with pytest.raises(InvalidRequest):
        ReasoningSealer(retired).open(sealed)


# -- across a restart of the app -------------------------------------------------------------------------------

SETTINGS = AppSettings.model_validate({"models": [{"id": "m1", "reasoning_parser": "qwen3"}]})


def start_app(open_store, environ: dict):
    """What a (re)started deployment builds: the ring from the same configuration, the store on the same file or
    database."""
    ring = keyring.load(SETTINGS.ingress.server_secret, environ=environ)
    svc = ResponsesStub()
    store = open_store()
    return create_app(IngressContext(settings=SETTINGS, service=svc, secret=ring,
                                     response_store=StoreClient(store))), svc, store


@pytest.fixture(params=["sqlite", "postgres"])
def open_store(request, tmp_path):
    if request.param == "sqlite":
        path = str(tmp_path / "responses.sqlite3")
        return lambda: SqliteResponseStore(path)
    dsn = fresh_database(request.getfixturevalue("postgres"))
    return lambda: PostgresResponseStore(dsn)


def oai(app):
    return openai.AsyncOpenAI(api_key="x", base_url="http://app/v1", max_retries=0,
                              http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))


async def test_previous_response_id_and_sealed_reasoning_continue_after_a_restart_with_rotation(open_store):
    app, _, store = start_app(open_store, {keyring.ENV: "k1"})
    first = await oai(app).responses.create(model="m1", input="run ls", include=["reasoning.encrypted_content"],
                                            extra_body={"nvext": {"forced_script": "think_call"}})
    reasoning = first.output[0]
    assert reasoning.encrypted_content
    if inspect.isawaitable(closed := store.close()):
        await closed

    # Restarted, with a new key rotated in front of the old one.
    app2, svc2, _ = start_app(open_store, {keyring.ENV: "k2,k1"})
    await oai(app2).responses.create(model="m1", input="and now?", previous_response_id=first.id)
    conv = svc2.prepared[-1].conversation
    assert conv.messages[0].parts[0].text == "run ls" and conv.messages[-1].parts[0].text == "and now?"
    assert any(getattr(p, "text", None) == "I should run ls." for m in conv.messages for p in m.parts)
    # The sealed reasoning item the client holds opens too (stateless replay, store=False).
    follow = [{"role": "user", "content": "run ls"}, reasoning.model_dump(exclude_none=True),
              first.output[1].model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"}]
    await oai(app2).responses.create(model="m1", input=follow, store=False)
    assert svc2.prepared[-1].conversation.messages[1].parts[0].text == "I should run ls."


async def test_signed_thinking_continues_after_a_restart(tmp_path):
    from test_anthropic_routes import FakeService

    def start(environ):
        ring = keyring.load(None, environ=environ)
        svc = FakeService(ANTHROPIC)
        return create_app(IngressContext(settings=ANTHROPIC, service=svc, secret=ring)), svc

    def claude(app):
        return anthropic.AsyncAnthropic(api_key="x", base_url="http://app", max_retries=0,
                                        http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)))

    app, _ = start({keyring.ENV: "k1"})
    user = [{"role": "user", "content": "list files"}]
    msg = await claude(app).messages.create(model="test-model", max_tokens=100, messages=user,
                                            thinking={"type": "enabled", "budget_tokens": 50},
                                            extra_body={"nvext": {"forced_script": "think_text_tool"}})
    thinking = msg.content[0]
    assert thinking.type == "thinking" and thinking.signature
    history = [*user, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": msg.content[-1].id,
                                             "content": "a.txt"}]}]
    app2, svc2 = start({keyring.ENV: "k2,k1"})  # restarted, key rotated
    reply = await claude(app2).messages.create(model="test-model", max_tokens=100, messages=history,
                                               thinking={"type": "enabled", "budget_tokens": 50})
    assert reply.content
    app3, _ = start({})  # what used to happen: a random key per deploy
    with pytest.raises(anthropic.BadRequestError) as e:
        await claude(app3).messages.create(model="test-model", max_tokens=100, messages=history,
                                           thinking={"type": "enabled", "budget_tokens": 50})
    assert "Invalid `signature`" in e.value.message


ANTHROPIC = AppSettings.model_validate({"models": [{"id": "test-model", "reasoning_parser": "qwen3",
                                                    "max_output_tokens": 1024}]})


def test_a_tenants_keys_rotate_with_the_servers_and_open_nothing_of_anothers():
    """keyring.for_tenant: each server key derived for the tenant, the server keys last (to open what was sealed
    before tenants had keys of their own). Rotating the server keys rotates every tenant's."""
    old = keyring.load(["k-old"])
    alice = keyring.for_tenant(old, "alice")
    assert alice.keys[-1:] == old.keys and bytes(alice) not in old.keys
    assert bytes(keyring.for_tenant(old, "bob")) != bytes(alice)
    sig, sealed = signatures.sign(alice, "thinking"), ReasoningSealer(alice).seal("reasoning")
    bob = keyring.for_tenant(old, "bob")
    assert not signatures.verify(bob, "thinking", sig)
    with pytest.raises(InvalidRequest):
        ReasoningSealer(bob).open(sealed)
    rotated = keyring.for_tenant(keyring.load(["k-new", "k-old"]), "alice")
    assert signatures.verify(rotated, "thinking", sig) and ReasoningSealer(rotated).open(sealed) == "reasoning"
    assert bytes(rotated) not in alice.keys  # it signs with the new key's derivation
    both = keyring.for_tenants(old, ["alice", "bob"])  # the front door's: opens either's, signs nothing
    assert ReasoningSealer(both).open(sealed) == "reasoning" and signatures.verify(both, "thinking", sig)
    # What the server keys made (before tenants had keys) opens for every tenant, unless the operator stops it.
    legacy_sig, legacy_sealed = signatures.sign(old, "thinking"), ReasoningSealer(old).seal("reasoning")
    assert signatures.verify(bob, "thinking", legacy_sig) and ReasoningSealer(bob).open(legacy_sealed)
    strict = keyring.for_tenant(old, "bob", server_keys=False)
    assert bytes(strict) == bytes(bob) and strict.keys == bob.keys[:-1]
    assert not signatures.verify(strict, "thinking", legacy_sig)
    with pytest.raises(InvalidRequest):
        ReasoningSealer(strict).open(legacy_sealed)
    assert not signatures.verify(keyring.for_tenants(old, ["alice", "bob"], server_keys=False), "thinking", legacy_sig)
