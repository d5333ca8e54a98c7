"""Pydantic configuration of the whole app, loaded from the Serve config's `args` (or a YAML file).

One `AppSettings` describes every deployment: the models (each an Engine deployment), the router and the
ingress. `build_app(args)` validates `args` into this model, so a typo in `config.yaml` fails at deploy time
with the field's path in the message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.engine.fair_share import MAX_SHARE
from serve_app.ingress.autoscaling import with_listener_policy


class _Strict(BaseModel):
    # Errors name the field's path and the problem but never echo the input: it may be an API key or the secret.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)


class DeploymentOptions(_Strict):
    """Ray Serve deployment options passed through to `.options(...)`."""

    num_replicas: int | Literal["auto"] = 1
    max_ongoing_requests: int | None = None
    max_queued_requests: int | None = None
    autoscaling_config: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] = Field(default_factory=dict)
    placement_group_bundles: list[dict[str, float]] | None = None
    placement_group_strategy: str | None = None
    graceful_shutdown_timeout_s: float | None = None
    health_check_period_s: float | None = None

    def serve_options(self) -> dict[str, Any]:
        opts = self.model_dump(exclude_none=True)
        if self.autoscaling_config is not None:
            opts.pop("num_replicas", None)
        if not opts.get("ray_actor_options"):
            opts.pop("ray_actor_options", None)
        return opts


class ModelConfig(_Strict):
    """One served model: the weights, how vLLM runs them and how its output is parsed."""

    id: str  # the served model id clients use
    # A model family from serve_app/families/catalog.yaml: fills reasoning_parser, tool_parser and
    # default_chat_template_kwargs (fields set here win); family_template renders with the family's vendored template.
    family: str | None = None
    family_template: bool = False
    source: str | None = None  # HF id, local path, or an embedded default name; defaults to `id`
    aliases: list[str] = Field(default_factory=list)  # further ids answered by the same engine
    display_name: str | None = None
    max_model_len: int = 8192
    max_output_tokens: int = 4096
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    chat_template: str | None = None  # a path or an inline Jinja template overriding the tokenizer's
    default_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # The template kwarg that switches thinking, set beside `enable_thinking` (which most templates read) when it
    # differs: Kimi K3's template reads `thinking` only. A family fills it in.
    thinking_kwarg: str = "enable_thinking"
    # What that kwarg is set to for thinking on and off (MiniMax-M3's `thinking_mode` takes "enabled" / "disabled");
    # `enable_thinking` itself stays a bool. A family fills it in.
    thinking_values: tuple[Any, Any] = (True, False)
    # The template kwarg a request's reasoning effort goes to, and its values by effort ({} passes the effort on
    # as is; with a map, an effort it lacks sets nothing and the template's default stands). A family fills them in.
    effort_kwarg: str = "reasoning_effort"
    effort_values: dict[str, str] = Field(default_factory=dict)
    hf_overrides: dict[str, Any] = Field(default_factory=dict)
    # Every layer attends to at most this many preceding tokens (vLLM's sliding-window attention, switched on
    # through the model's config): a model trained at N tokens serves a longer max_model_len with prefill cost
    # linear in the length, and within the window it is the unmodified model (docs/architecture.md, "Long context
    # on the CPU default"). Only for architectures whose vLLM implementation reads `layer_types` (Llama, Qwen,
    # Mistral, ...): the engine refuses to start if vLLM did not apply it.
    sliding_window: int | None = Field(default=None, gt=0)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)  # extra AsyncEngineArgs fields
    engine_env: dict[str, str] = Field(default_factory=dict)  # env vars for the engine replica (e.g. KV cache GiB)
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions)
    created_at: str = "2026-11-01T00:00:00Z"

    @property
    def model_source(self) -> str:
        return self.source or self.id

    @property
    def all_ids(self) -> list[str]:
        return [self.id, *self.aliases]

    @model_validator(mode="before")
    @classmethod
    def _apply_family(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("family"):
            from serve_app.families import apply_family

            return apply_family(data)
        if isinstance(data, dict) and data.get("family_template"):
            raise ValueError("family_template needs a family")
        return data

    @field_validator("chat_template")
    @classmethod
    def _resolve_template_path(cls, value: str | None) -> str | None:
        """A relative template path is looked up from the working directory, then from the project root."""
        if value is None or "{" in value or Path(value).is_absolute():
            return value
        for base in (Path.cwd(), Path(__file__).resolve().parent.parent):
            candidate = base / value
            if candidate.exists():
                return str(candidate)
        return value

    @model_validator(mode="after")
    def _check_lengths(self) -> "ModelConfig":
        if self.max_output_tokens > self.max_model_len:
            raise ValueError(f"max_output_tokens ({self.max_output_tokens}) > max_model_len ({self.max_model_len})")
        if self.sliding_window is not None and self.sliding_window >= self.max_model_len:
            raise ValueError(f"sliding_window ({self.sliding_window}) must be below max_model_len "
                             f"({self.max_model_len}): a window that long changes nothing")
        return self


class RouterConfig(_Strict):
    # ttft: lowest predicted time to first token from measured replica rates (routing/ttft.py), the simulation's
    # best on every trace (load/results/router_compare.json); the others are baselines.
    policy: str = "ttft"  # a name in serve_app/routing/registry.py POLICIES (build_app checks it)
    # kv policy only: weight of a cached prompt token against a queued one. A prefix sent elsewhere is recomputed there and evicts
    # other prefixes; 32 is the simulation's best hit rate at imbalance ~1.0 (load/sim_router.py); 1 is
    # Dynamo's TTFT-first setting.
    overlap_weight: float = 32.0
    prediction_ttl_s: float = 120.0
    prediction_max_blocks: int = 200_000
    kv_events: bool = True
    # Where decisions are made. `ingress`: each Ingress replica holds its own routing table, fed by every
    # engine's KV events and following the Router deployment's membership and policy (routing/local.py), so a
    # decision is a function call, not a Serve round trip per request (docs/serving-path.md); loads and
    # reservations are then per ingress replica (exact with one, approximate with several). `deployment`: the one
    # Router replica decides every request, with the load of all ingresses.
    placement: Literal["ingress", "deployment"] = "ingress"
    sync_interval_s: float = Field(default=1.0, gt=0)  # how often an ingress-local table follows the Router
    # With `engine_placement: ingress`: the front door (Serve's HAProxy) asks the Router which ingress replica
    # holds each request's prefix before forwarding it there (routing/front_door.py), instead of spreading
    # requests with no affinity. For several ingress replicas; needs direct ingress and the controller flags of
    # serve_tuning.FRONT_DOOR.
    front_door: bool = False
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions)


class ApiKey(_Strict):
    """One key of a tenant. An entry without `key` serves requests that present no key, or one matching no
    entry, as its tenant: open access beside keyed tenants (the test config uses it)."""

    key: str | None = Field(default=None, min_length=1)
    tenant: str


class TenantConfig(_Strict):
    """A tenant's limits and prefix-cache namespace (serve_app/tenants.py). Unset limits are unlimited."""

    # Tenants with the same cache_group share cached prefixes (one organisation); by default each tenant has its
    # own. The unnamed default tenant (plain keys, or no keys at all) keeps the shared, unsalted cache.
    cache_group: str | None = None
    max_concurrent_requests: int | None = Field(default=None, ge=1)
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)  # prompt tokens at admission + output at the end
    models: list[str] | None = None  # served ids (or aliases) this tenant may call; None = all
    # The tenant's scheduling tier in the engines (vLLM's priority scheduling; higher first): under load its waiting
    # requests are admitted before those of every tenant with a lower priority, and a running one of theirs may be
    # preempted for them. A request's own `agent_hints.priority` orders it within its tenant's tier, never across
    # (tenants.engine_priority).
    priority: int = Field(default=0, ge=-100, le=100)
    # The tenant's weight among the tenants of its tier (`ingress.fair_share`): while both have requests waiting
    # for an engine, a tenant of share 2 is admitted twice as often as one of share 1 (engine/fair_share.py).
    share: int = Field(default=1, ge=1, le=MAX_SHARE)

    @property
    def limited(self) -> bool:
        return any(v is not None for v in (self.max_concurrent_requests, self.requests_per_minute,
                                            self.tokens_per_minute))


class ListenConfig(_Strict):
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=0, le=65535)
    keep_alive_s: float = Field(default=90.0, gt=0)  # idle keep-alive connections, as Serve's HTTP servers keep them
    # On shutdown (a redeploy, a scale-down, a replaced replica) the replica stops accepting, and its open requests
    # get this long to finish; keep it under the ingress deployment's graceful_shutdown_timeout_s (Serve's 20 s),
    # after which Serve stops the process anyway.
    drain_s: float = Field(default=15.0, ge=0)


class IngressConfig(_Strict):
    # Plain strings (the default tenant) or {key, tenant} entries; empty = open.
    api_keys: list[str | ApiKey] = Field(default_factory=list)
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    # Tenants of one tier share each engine's queue fairly (serve_app/engine/fair_share.py): a tenant with many
    # requests waiting no longer holds back another's next one. false: first come, first served within a tier.
    fair_share: bool = True
    log_requests: bool = True  # one JSON line per request on stdout (serve_app/request_log.py)
    log_request_text: bool = False  # debug only: also the prompt's last input text in that line
    max_body_bytes: int = 32 * 1024 * 1024
    max_decompressed_bytes: int = 64 * 1024 * 1024
    strip_preamble: bool = True
    tool_dispatch: bool = False  # Chat Completions `event: tool_call_dispatch` side channel, to requests with nvext.tool_dispatch
    # How Chat Completions streams a tool call: `stream` sends its arguments as generated (as OpenAI and vLLM do;
    # clients that render a file being written see it grow), `hold` sends each call whole once it is complete, so a
    # call the parser abandons (cut off by the limit, or malformed mid-stream) never reaches the client — one that
    # runs calls from partially parsed arguments would run it. A request's `nvext.hold_tool_calls` chooses for itself.
    chat_tool_calls: Literal["stream", "hold"] = "stream"
    ping_interval_s: float = 10.0
    render_timeout_s: float = 30.0
    # Threads rendering and tokenizing prompts, per model. Templates run under the GIL and tokenizing is
    # serialised per model, so more threads add no parallelism, only contention with the event loop that streams
    # tokens: at 128 requests arriving at once, one thread's render queue is ~30% shorter (p50) than four's and
    # two's (docs/serving-path.md "The load generator's wait"), as vLLM's own renderer pool is one thread. More
    # than one keeps short renders going while one template is slow (tokenizing waits on the encode lock anyway).
    render_threads: int = Field(default=1, ge=1, le=64)
    # Prompt characters (those the tokenizer memo does not hold) that a render may tokenize on the event loop
    # itself instead of in the render pool, ~1.5 ms of CPU at 4,096; 0 sends every render to the pool. A pool
    # thread beside a busy loop waits for the GIL far longer than a small render takes (PromptRenderer.render).
    render_inline_chars: int = Field(default=4096, ge=0)
    max_inflight_requests: int = 256  # per ingress replica; beyond it: overloaded at once (529; OpenAI APIs 503)
    router_timeout_s: float = 0.5  # past this the ingress routes least-loaded without the Router
    # Signs thinking blocks / encrypts reasoning. A list is a key ring, newest first: new signatures use the
    # first, every listed key still verifies, so a key rotates without breaking sessions. Unset: the
    # SERVE_APP_SERVER_SECRET environment variable (comma-separated ring), else random per deploy (a warning).
    server_secret: str | list[str] | None = None
    # Thinking signatures and Responses encrypted_content made with the server keys themselves, as every version
    # before per-tenant keys (December 2026) made them, still verify and open for any tenant, so sessions go on
    # across the upgrade. false once those sessions are over: then only what was made for the tenant opens
    # (keyring.for_tenant).
    accept_server_key_items: bool = True
    # sqlite: a file on the node running the ResponseStore replica (one node); postgres: a server database, for a
    # multi-node cluster (the replica may come back on any node); memory: lost on restart.
    response_store_backend: Literal["sqlite", "memory", "postgres"] = "sqlite"
    # SQLite file of the Responses store (on the node running the ResponseStore replica); default
    # ~/.cache/serve_app/responses.sqlite3
    response_store_path: str | None = None
    # PostgreSQL DSN (`postgresql://user:password@host:5432/db` or `host=... dbname=...`) for the postgres backend.
    # Unset: the SERVE_APP_RESPONSE_STORE_DSN environment variable of the store's replica (a Secret on KubeRay),
    # which keeps the password out of the config. Never logged.
    response_store_dsn: str | None = Field(default=None, repr=False)
    # The longest a Responses store call may take (SQLite's wait for a write lock, PostgreSQL's connect and
    # statement_timeout, and the store deployment's own bound on each call); past it the request gets 503
    # `store_unavailable` instead of hanging on a stuck database.
    response_store_timeout_s: float = Field(default=5.0, gt=0)
    response_store_max_items: int = 10_000
    response_store_ttl_s: float = 3600.0
    # deployment: one ResponseStore replica every ingress replica calls; ingress: each ingress replica opens the
    # database itself, one Ray worker process fewer (sqlite: the replicas of one host share the file; postgres:
    # any replicas; not memory, which each replica would keep to itself). ingress/responses/store.py.
    response_store_placement: Literal["deployment", "ingress"] = "deployment"
    # Ingress replicas serve HTTP themselves behind Serve's HAProxy, with no Python proxy hop per token
    # (docs/serving-path.md). The Serve config's controller_options must say the same (serve_tuning.DIRECT_INGRESS).
    direct_ingress: bool = False
    # With direct ingress, who notices a client that leaves: `app` — Starlette's streaming response and the
    # routes' own watcher for answers that are not streamed (ingress/streaming.py) — or `serve`, Ray Serve's
    # direct-ingress wrapper, which puts a receive task and a second task in front of every request and costs
    # each new request event-loop turns under load (docs/serving-path.md "A new request's way into the app").
    disconnects: Literal["app", "serve"] = "app"
    # Each ingress replica listens on this address itself (SO_REUSEPORT: every replica on a host shares the port,
    # the kernel spreads connections among them), and Serve runs no proxy (the Serve config's `proxy_location:
    # Disabled`): no HAProxy or Python proxy process between a client and the app (ingress/listener.py,
    # docs/serving-path.md "No proxy"). Not with direct_ingress (HAProxy's front door) or router.front_door.
    listen: ListenConfig | None = None
    response_store_max_bytes: int = 512 * 1024 * 1024
    # Each ingress replica (and the front door's Router) keeps the records it stored or read lately, up to about
    # this many bytes, and reads a follow-up's chain from them, asking the store only whether the response it
    # continues is still there, or reading that one record alone when it holds the rest
    # (ingress/responses/recent.py): the next turn of a session comes back to the replica that stored the last one
    # (the front door sends it there, and one replica always is). 0: every chain is read from the store.
    response_store_recent_bytes: int = Field(default=64 * 1024 * 1024, ge=0)
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions)

    # Serve's own cap on an ingress replica (its default is 5) must sit above max_inflight_requests: otherwise the
    # excess waits in Serve's queue, unseen by admission, instead of getting a fast 529 in the API's envelope.
    # The headroom carries the cheap calls (health, models, count_tokens) and the refusals themselves.
    OVERLOAD_HEADROOM: ClassVar[int] = 64
    SERVE_GRACEFUL_SHUTDOWN_S: ClassVar[float] = 20.0  # Serve's default graceful_shutdown_timeout_s

    @property
    def tenants_limited(self) -> bool:
        """Whether some tenant has limits (and so a limit state must run)."""
        return any(t.limited for t in self.tenants.values())

    @model_validator(mode="after")
    def _keys_name_tenants(self) -> "IngressConfig":
        seen: set[str] = set()
        for entry in self.api_keys:
            key = entry if isinstance(entry, str) else entry.key
            if key is not None:
                if key in seen:
                    raise ValueError("ingress.api_keys: a key is listed twice")  # never echo a key
                seen.add(key)
            if isinstance(entry, ApiKey) and entry.tenant not in self.tenants and entry.tenant != "default":
                raise ValueError(f"ingress.api_keys: tenant {entry.tenant!r} is not in ingress.tenants")
        if sum(1 for e in self.api_keys if isinstance(e, ApiKey) and e.key is None) > 1:
            raise ValueError("ingress.api_keys: at most one entry without a key")
        return self

    @model_validator(mode="after")
    def _one_front(self) -> "IngressConfig":
        if self.listen is not None and self.direct_ingress:
            raise ValueError("ingress.listen and ingress.direct_ingress are two fronts for the same replicas: the "
                             "replicas' own port, or Serve's HAProxy in front of them; choose one")
        if self.listen is not None:
            grace = self.deployment.graceful_shutdown_timeout_s
            grace = self.SERVE_GRACEFUL_SHUTDOWN_S if grace is None else grace
            if self.listen.drain_s >= grace:
                raise ValueError(f"ingress.listen.drain_s ({self.listen.drain_s}) must be below the ingress "
                                 f"deployment's graceful_shutdown_timeout_s ({grace}): Serve stops the replica then, "
                                 "open requests or not")
            scaling = self.deployment.autoscaling_config or {}
            if scaling and scaling.get("min_replicas", 1) == 0:
                raise ValueError("ingress.deployment.autoscaling_config.min_replicas must be at least 1 with "
                                 "ingress.listen: the replicas are the only thing listening on the port, so with "
                                 "none no request could ever arrive to scale them up")
        return self

    @model_validator(mode="after")
    def _shared_store(self) -> "IngressConfig":
        if self.response_store_placement == "ingress" and self.response_store_backend == "memory":
            raise ValueError("ingress.response_store_placement 'ingress' needs a database the replicas share "
                             "(response_store_backend 'sqlite' or 'postgres'): in memory each replica would keep "
                             "its own responses")
        return self

    @model_validator(mode="after")
    def _serve_cap_above_admission(self) -> "IngressConfig":
        cap = self.deployment.max_ongoing_requests
        if self.max_inflight_requests and cap is not None and cap <= self.max_inflight_requests:
            raise ValueError(
                f"ingress.deployment.max_ongoing_requests ({cap}) must exceed ingress.max_inflight_requests "
                f"({self.max_inflight_requests}), or overload queues in Serve instead of being refused with 529"
            )
        return self

    def serve_options(self) -> dict[str, Any]:
        """The ingress deployment's Serve options, with max_ongoing_requests defaulted above admission."""
        opts = self.deployment.serve_options()
        if "max_ongoing_requests" not in opts:
            opts["max_ongoing_requests"] = (self.max_inflight_requests or 1024) + self.OVERLOAD_HEADROOM
        if self.listen is not None and "autoscaling_config" in opts:
            # Serve counts none of the requests on the replicas' own port: scale on the count they report.
            opts["autoscaling_config"] = with_listener_policy(opts["autoscaling_config"])
        return opts


class TestingConfig(_Strict):
    # Loads the forcing logits processor into the engines and lets a request carry `nvext.forced_script`.
    # Only test configs turn this on.
    forced_scripts: bool = False
    # For real CLIs that cannot add body fields: when the last user/tool message matches `match` (a regex),
    # the engine is forced to say `script`. Rules live in the test config, so no state is shared at run time.
    script_rules: list["ScriptRule"] = Field(default_factory=list)


class ScriptRule(_Strict):
    match: str
    script: str
    model: str | None = None  # only for requests naming this model (as sent: an id or an alias)


TestingConfig.model_rebuild()


class EngineRestarts(_Strict):
    """With `engine_placement: ingress` (and the single process): an engine whose engine core died is replaced in
    place while the process's other engines serve on; its requests meanwhile get 503 with Retry-After. Past
    `limit` replacements of one engine within `window_s` (or when a replacement fails to start) the process's
    health check fails instead, and the whole process is replaced: by Serve, or by the single process's
    supervisor after it exits. `limit: 0` leaves every dead engine to that."""

    limit: int = Field(default=3, ge=0)
    window_s: float = Field(default=600.0, gt=0)


class AppSettings(_Strict):
    models: list[ModelConfig]
    router: RouterConfig = Field(default_factory=RouterConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    testing: TestingConfig = Field(default_factory=TestingConfig)
    model_cache_dir: str | None = None  # where converted default weights live; default ~/.cache/serve_app/models
    # Where the engines run. `deployment`: an Engine deployment per engine, its replicas reached over a Serve call
    # and the delta channel, each request sent to the replica that holds its prefix (the KV-aware router).
    # `ingress`: every ingress replica runs the engines in its own process, as vLLM's API server does — no Serve
    # call and no relay process on a token's path (docs/serving-path.md). With several ingress replicas the front
    # door spreads requests with no prefix affinity unless `router.front_door` is on, which has it ask the Router
    # which replica holds each request's prefix. Their resources are the ingress deployment's
    # (`ingress.deployment.ray_actor_options`).
    engine_placement: Literal["deployment", "ingress"] = "deployment"
    engine_restarts: EngineRestarts = Field(default_factory=EngineRestarts)

    @field_validator("models")
    @classmethod
    def _unique_ids(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        seen: set[str] = set()
        for m in models:
            for mid in m.all_ids:
                if mid in seen:
                    raise ValueError(f"model id {mid!r} is listed twice")
                seen.add(mid)
        if not models:
            raise ValueError("at least one model is required")
        return models

    @model_validator(mode="after")
    def _engines_in_ingress(self) -> "AppSettings":
        if self.engine_placement == "ingress":
            for i, m in enumerate(self.models):
                if m.deployment != DeploymentOptions():
                    raise ValueError(f"models[{i}].deployment has no effect with engine_placement: ingress (the "
                                     "ingress replicas run the engines): set ingress.deployment instead")
        elif self.engine_restarts != EngineRestarts():  # by value: a dumped-and-reloaded default passes
            raise ValueError("engine_restarts has no effect with engine_placement: deployment (Serve replaces a dead "
                             "Engine replica by its health check): remove it, or run the engines in the ingress")
        if self.router.front_door:
            if self.engine_placement != "ingress":
                raise ValueError("router.front_door needs engine_placement: ingress (with the Engine deployment the "
                                 "Router already picks the engine replica)")
            if not self.ingress.direct_ingress:
                raise ValueError("router.front_door needs ingress.direct_ingress: true (it is HAProxy's hook)")
        return self

    def find_model(self, model_id: str) -> ModelConfig | None:
        for m in self.models:
            if model_id in m.all_ids:
                return m
        return None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "AppSettings":
        """Load settings from a Serve config file (first application's args) or a bare args file."""
        data = yaml.safe_load(Path(path).read_text())
        if isinstance(data, dict) and "applications" in data:
            data = data["applications"][0].get("args", {})
        return cls.model_validate(data)
