"""A vLLM AsyncLLM wrapped for the Engine deployment, with no Ray in it.

The ingress sends token ids it rendered itself (so the router hashes exactly what the engine sees); the
engine streams deltas (`output_kind=DELTA`: O(Δ) per step, not the whole text each time) and reports the
prefix-cache hit. Cancelling the consumer of `generate` aborts the vLLM request (AsyncLLM does that when its
generator is closed), which frees the KV blocks at once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any, AsyncIterator

from serve_app.engine import reaper
from serve_app.engine.fair_share import FairShare
from serve_app.engine.types import EngineChunk, EngineRequest
from serve_app.settings import ModelConfig

log = logging.getLogger(__name__)

FORCING_PROCESSOR = "serve_app.engine.forcing:ForcedScriptLogitsProcessor"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def cpu_float32(model_path: str) -> bool:
    """Whether a CPU engine should run this checkpoint in float32 instead of vLLM's default (bf16 on a CPU with
    native bf16). See `keeps_float32`; False off CPU (a GPU keeps vLLM's default)."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        flags = open("/proc/cpuinfo").read()
    except Exception:  # noqa: BLE001 - not Linux or no vLLM platform: keep vLLM's default
        return False
    return keeps_float32(flags, checkpoint_dtype(model_path))


def keeps_float32(cpu_flags: str, checkpoint: str | None) -> bool:
    """Float32 on a CPU without native bf16 (no AVX512-BF16/AMX): there vLLM's default bf16 runs through slow
    fallback kernels (a 3K-token prefill measured 75 s in bf16 vs 18 s in fp32 on this project's machines). And a
    float32 checkpoint stays float32 on any CPU: vLLM's default casts it to bf16 where the CPU has it, and the
    default 135M model, converted to float32 from its GGUF, then answered "What is the capital of France?" with
    "L'Étoile, la Marseillaise..." on an AMX host (Sapphire Rapids) where it says Paris in float32 — a small
    model's answers must not depend on which CPU serves it."""
    lacks_bf16 = "avx512_bf16" not in cpu_flags and "amx_bf16" not in cpu_flags
    return lacks_bf16 or checkpoint == "float32"


def checkpoint_dtype(model_path: str) -> str | None:
    """The dtype a local checkpoint's config.json declares (`dtype`, or the older `torch_dtype`), if any."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("torch_dtype")
    return dtype if isinstance(dtype, str) else None


# At or below this many usable CPUs, vLLM's auto binding (one core reserved for its scheduler process) costs more
# than it saves: on two cores it leaves one torch thread, and a 6K-token prefill measured 64 s vs 35 s on both.
SMALL_HOST_CPUS = 4


def cpu_thread_env(cpus: set[int], environ: dict[str, str]) -> dict[str, str]:
    """Env for a CPU engine on a small host: bind its OpenMP threads to every usable CPU instead of reserving one,
    and let them sleep at a barrier instead of spinning (OpenMP's passive wait). Bound to every core, the compute
    threads share their cores with the scheduler, the serving path and Ray's daemons; while one is preempted its
    spinning partner keeps the other core from everyone, and every stream stalled for 0.3-3 s at once, where a
    sleeping partner frees its core (docs/serving-path.md "Streams stalled together"). Each key only where the
    operator has not set it; nothing on a host big enough for vLLM's own choice."""
    if not cpus or len(cpus) > SMALL_HOST_CPUS:
        return {}
    out = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(cpus)), "OMP_WAIT_POLICY": "PASSIVE"}
    return {k: v for k, v in out.items() if k not in environ}


def _on_cpu_platform() -> bool:
    try:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()
    except Exception:  # noqa: BLE001 - no vLLM platform: nothing to tune
        return False


# Our reasoning-format names whose end marker one of vLLM's registered parsers recognises under another name.
_VLLM_REASONING_ALIASES = {"gpt_oss": "openai_gptoss", "nemotron_deci": "qwen3", "kimi_k25": "kimi_k2"}


def vllm_reasoning_parser(name: str | None, model_path: str) -> str | None:
    """vLLM's name for the reasoning parser that gates grammars for `name`, or None where it has none.

    vLLM's gate looks for the end marker as one token id; where the tokenizer splits it (a test model given a
    think template) the gate would never open and the grammar never apply, so there is no gate at all then.
    """
    if not name:
        return None
    try:
        from vllm.reasoning import ReasoningParserManager
    except ImportError:
        return None
    from serve_app.parsers.formats import REASONING_PARSERS

    vllm_name = _VLLM_REASONING_ALIASES.get(name, name)
    fmt = REASONING_PARSERS.get(name)
    if fmt is None or vllm_name not in ReasoningParserManager.list_registered():
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return vllm_name if len(tokenizer.encode(fmt.end, add_special_tokens=False)) == 1 else None


def check_window_applied(wanted: int | None, model_config) -> None:
    """Raise unless vLLM's model config has the window the model entry asked for: a model whose vLLM
    implementation ignores `layer_types` would otherwise run full attention at 32K, silently and far slower."""
    applied = model_config.get_sliding_window()
    if wanted and applied != wanted:
        raise RuntimeError(f"sliding_window {wanted} was not applied by vLLM's implementation of this model "
                           f"(window in effect: {applied}); remove it from the model's config")


def sliding_window_overrides(model_path: str, window: int, max_model_len: int) -> dict[str, Any]:
    """The model-config overrides that make every layer a sliding-window layer of `window` tokens.

    vLLM's model implementations read the window per layer from `layer_types`; `max_position_embeddings` is raised
    to `max_model_len` because vLLM refuses a longer context than the config declares (with rotary embeddings
    only relative distances reach the attention, and within the window they stay in the trained range)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path).get_text_config()
    return {
        "layer_types": ["sliding_attention"] * cfg.num_hidden_layers,
        "sliding_window": window,
        "max_position_embeddings": max(getattr(cfg, "max_position_embeddings", 0) or 0, max_model_len),
    }


def first_chunk_ms(entered: float, stats: Any, now: float) -> dict[str, float] | None:
    """Where the first chunk's time went inside the replica, in ms, from vLLM's per-request stats (engine-core
    timestamps, time.monotonic() of the same host): `handoff` (generate() called → the engine core queued it),
    `queued` (→ scheduled), `prefill` (→ first token), `out` (→ the chunk back in this replica). A step vLLM did not
    time (stats off, or a zero timestamp) is absent; None when none was timed."""
    if stats is None:
        return None
    points = [("handoff", getattr(stats, "queued_ts", 0.0)), ("queued", getattr(stats, "scheduled_ts", 0.0)),
              ("prefill", getattr(stats, "first_token_ts", 0.0)), ("out", now)]
    out, last = {}, entered
    for name, t in points:
        if not t:
            continue
        out[name] = round((t - last) * 1000, 2)
        last = t
    return out if len(out) > 1 else None


# vLLM's CPU platform reads VLLM_CPU_KVCACHE_SPACE (GiB, its legacy setting) from this process's environment as it
# builds an engine's config, and it overrides the engine's `kv_cache_memory_bytes`. Each engine's value (its
# engine_env's, else the process's own) goes into its engine args instead, and the variable leaves this process's
# environment: engines of one process with different KV cache sizes then set the same environment and start
# together (start_engines).
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
_kv_space_lock = threading.Lock()
_process_kv_space: list[str | None] = []  # the process's own value, read once as it leaves the environment


def kv_cache_gib(model: ModelConfig) -> str | None:
    """A CPU engine's KV cache size in GiB: its engine_env's VLLM_CPU_KVCACHE_SPACE, else the process's."""
    with _kv_space_lock:
        # Removed on every call: set again since (an operator's library, a test), it is still not vLLM's to read.
        value = os.environ.pop(KV_SPACE_ENV, None)
        if not _process_kv_space:
            _process_kv_space.append(value)
        return model.engine_env.get(KV_SPACE_ENV) or _process_kv_space[0] or None


def build_engine_args(
    model: ModelConfig,
    model_path: str,
    *,
    forced_scripts: bool = False,
    kv_events_port: int | None = None,
    kv_replay_port: int | None = None,
    priority_scheduling: bool = True,
    kv_cache_gib: str | None = None,
):
    from vllm.config import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs: dict[str, Any] = {
        "model": model_path,
        "served_model_name": [model.id],
        "max_model_len": model.max_model_len,
        "enable_prefix_caching": True,
        # Priority lets `agent_hints.priority` reach vLLM's scheduler.
        "scheduling_policy": "priority" if priority_scheduling else "fcfs",
    }
    overrides = dict(model.hf_overrides)
    if model.sliding_window:
        overrides = {**sliding_window_overrides(model_path, model.sliding_window, model.max_model_len), **overrides}
        # vLLM keeps a sliding-window group's prefix blocks only at a request's last window and at shared-prefix
        # junctions (`prefix_cache_retention_interval: 0`), and it finds a junction only where a full-attention
        # group hits further. With every layer windowed there is no such group: a second agent session sharing the
        # first's system prompt and tools, or a history edited before its last window, recomputed the whole prompt
        # (load/results/ttft_16k*.json). Every block is kept instead, as with full attention; kept blocks stay
        # evictable like any other.
        kwargs["prefix_cache_retention_interval"] = None
    if overrides:
        kwargs["hf_overrides"] = overrides
    if kv_events_port is not None:
        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{kv_events_port}",
            replay_endpoint=f"tcp://*:{kv_replay_port}" if kv_replay_port else None,
        )
    if forced_scripts:
        kwargs["logits_processors"] = [FORCING_PROCESSOR]
    gate = vllm_reasoning_parser(model.reasoning_parser, model_path)
    if gate is not None and "reasoning_parser" not in model.engine_kwargs:
        # vLLM's structured-output manager holds a grammar back until this parser sees the reasoning end, so a
        # thinking model reasons freely and only its answer is constrained. (Our own parsers still do the parsing.)
        kwargs["reasoning_parser"] = gate
    if "dtype" not in model.engine_kwargs and cpu_float32(model_path):
        kwargs["dtype"] = "float32"
    if kv_cache_gib:  # a CPU engine's VLLM_CPU_KVCACHE_SPACE (kv_cache_gib()); engine_kwargs' own value wins
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib) << 30
    kwargs.update(model.engine_kwargs)
    return AsyncEngineArgs(**kwargs)


def freeze_vllm_envs() -> None:
    from vllm import envs

    envs.enable_envs_cache()


def thaw_vllm_envs() -> None:
    """vLLM's settings read from the environment again (an engine started after `freeze_vllm_envs`: its engine
    core takes them from this process)."""
    from vllm import envs

    envs.disable_envs_cache()


_CPU_STOP_GRACE_S = 1.0


def start_engines(engines: list["VLLMEngine"]) -> None:
    """Start `engines` in this process (vLLM's settings are left unfrozen: `freeze_vllm_envs` after). Engines that
    set the same environment start at the same time, each in a thread of its own: a start is mostly spawning vLLM's
    engine core and worker processes and importing vLLM into each, one core apiece, while this process's own part
    holds Python's lock (config.yaml's two engines: 0.81x the time of one after another on two cores,
    load/results/engine_start.json). Engines whose environments differ (a GPU each, other `engine_env`) start one
    group after another, since their engine cores take it from this process's environment as they spawn. One
    reaper watches each group's new processes (reaper.py). If any start fails, every engine started is stopped and
    the first error raised."""
    groups: dict[tuple, list[VLLMEngine]] = {}
    for engine in engines:
        groups.setdefault(tuple(sorted(engine.environment().items())), []).append(engine)
    try:
        for group in groups.values():
            _start_group(group)
    except BaseException:
        for engine in engines:
            if engine.engine is not None:
                engine.shutdown()
        raise


def _start_group(group: list["VLLMEngine"]) -> None:
    if len(group) == 1:
        group[0].start(cache_envs=False)
        return
    before = reaper.children()
    guard = reaper.Guard(before)  # watching from now: a replica killed mid-start leaves no engine behind
    errors: list[BaseException] = []

    def start(engine: VLLMEngine) -> None:
        try:
            engine.start(cache_envs=False, watched=False)
        except BaseException as e:  # noqa: BLE001 - raised in the starting thread below
            errors.append(e)

    try:
        threads = [threading.Thread(target=start, args=(e,), name=f"engine-start-{i}") for i, e in enumerate(group)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        watcher = guard.arm(reaper.children() - before)
        for engine in group:
            engine._reaper = watcher
    if errors:
        raise errors[0]


class VLLMEngine:
    """Owns one AsyncLLM. `start()` builds it; `generate()` streams `EngineChunk`s."""

    def __init__(self, model: ModelConfig, model_path: str, *, forced_scripts: bool = False, kv_events: bool = True,
                 stat_loggers: list | None = None):
        self.model = model
        self.stat_loggers = stat_loggers  # vLLM StatLoggerFactory list; None keeps vLLM's default loggers
        self.model_path = model_path
        self.forced_scripts = forced_scripts
        self.kv_events_port = free_port() if kv_events else None
        self.kv_replay_port = free_port() if kv_events else None
        self.engine = None
        self._reaper = None  # the watcher that stops vLLM's processes if this one is killed (reaper.py)
        self.block_size: int | None = None
        self.max_model_len: int = model.max_model_len
        self.reasoning_gate = False  # vLLM holds grammars back until the think block ends
        # Sampling defaults for what a request leaves unset: the model's generation_config.json with the config's
        # `override_generation_config` on top, as vLLM's own server applies them (read at start).
        self.default_sampling: dict[str, Any] = {}
        # Tenants' shares of this engine's queue (fair_share.py); only under vLLM's priority policy, which alone
        # takes priorities (read at start).
        self.fair: FairShare | None = None

    def environment(self) -> dict[str, str]:
        """What this engine sets in this process's environment before it starts: its engine core and vLLM's
        settings read it from there (`engine_env`, and on a CPU its threads' binding)."""
        env = dict(self.model.engine_env)
        if _on_cpu_platform():
            env = {**cpu_thread_env(os.sched_getaffinity(0), {**os.environ, **env}), **env}
            env.pop(KV_SPACE_ENV, None)  # an engine arg instead (kv_cache_gib)
        return env

    def start(self, cache_envs: bool = True, watched: bool = True) -> None:
        """`cache_envs=False` where more engines start in this process after this one: their engine cores are
        started from this process and read their settings (`engine_env`) from it, so vLLM's settings are frozen
        only after the last (`freeze_vllm_envs`). `watched=False`: the caller has a reaper watching for the
        processes this start creates (`start_engines`, which starts several at once)."""
        from vllm.v1.engine.async_llm import AsyncLLM

        for key, value in self.environment().items():
            os.environ[key] = value
        args = build_engine_args(
            self.model,
            self.model_path,
            forced_scripts=self.forced_scripts,
            kv_events_port=self.kv_events_port,
            kv_replay_port=self.kv_replay_port,
            kv_cache_gib=kv_cache_gib(self.model) if _on_cpu_platform() else None,
        )
        self.reasoning_gate = bool(getattr(args, "reasoning_parser", None))
        if watched:
            before = reaper.children()
            guard = reaper.Guard(before)  # watching from now: a replica killed mid-start leaves no engine behind
            try:
                self.engine = AsyncLLM.from_engine_args(args, stat_loggers=self.stat_loggers)
            finally:
                self._reaper = guard.arm(reaper.children() - before)
        else:
            self.engine = AsyncLLM.from_engine_args(args, stat_loggers=self.stat_loggers)
        # vLLM reads its settings from the environment through a module __getattr__ on every access, several
        # times per output on the output path (a tenth of the replica's output thread, profiled); its engine core
        # freezes them after start-up and so does this process now that the engine is up.
        if cache_envs:
            freeze_vllm_envs()
        cfg = self.engine.vllm_config
        try:
            check_window_applied(self.model.sliding_window, cfg.model_config)
        except RuntimeError:
            self.shutdown()
            raise
        self.default_sampling = {k: v for k, v in cfg.model_config.get_diff_sampling_param().items()
                                 if k != "max_tokens"}  # the service sizes every request's max_tokens itself
        if self.default_sampling:
            log.info("sampling defaults for requests that set none: %s", self.default_sampling)
        self.block_size = cfg.cache_config.block_size
        self.max_model_len = cfg.model_config.max_model_len
        self.fair = FairShare() if str(cfg.scheduler_config.policy) == "priority" else None

    def sampling_params(self, req: EngineRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        extra: dict[str, Any] | None = None
        if req.forced_token_ids is not None:
            if not self.forced_scripts:
                raise ValueError("forced scripts are disabled on this engine")
            extra = {"forced_token_ids": req.forced_token_ids, "forced_eos_id": req.forced_eos_id}
        params: dict[str, Any] = {
            **self.default_sampling,  # what the request sets below wins
            "max_tokens": req.max_tokens,
            "output_kind": RequestOutputKind.DELTA,
            "skip_special_tokens": req.skip_special_tokens,
            "stop": req.stop or None,
            "extra_args": extra,
            "ignore_eos": req.ignore_eos,
            "min_tokens": req.min_tokens,
        }
        if req.temperature is not None:
            params["temperature"] = req.temperature
        if req.top_p is not None:
            params["top_p"] = req.top_p
        if req.top_k is not None:
            params["top_k"] = req.top_k
        if req.seed is not None:
            params["seed"] = req.seed
        for name in ("frequency_penalty", "presence_penalty", "logit_bias"):
            value = getattr(req, name)
            if value is not None:
                params[name] = value
        if req.forced_token_ids is not None:
            params["temperature"] = 0.0
        elif req.structured is not None:  # a forced script is exact text already; a grammar would fight it
            from vllm.sampling_params import StructuredOutputsParams

            params["structured_outputs"] = StructuredOutputsParams(**req.structured)
        return SamplingParams(**params)

    def validate(self, req: EngineRequest) -> None:
        """Raise vLLM's own validation error for a request it would refuse (an output schema its grammar cannot
        compile, ...), before the replica reports the request taken: the client then gets a plain 400 rather
        than a stream that fails after its head. Checked on a copy; vLLM checks the real one again."""
        if req.structured is None:
            return
        import copy

        assert self.engine is not None, "engine not started"
        proc = self.engine.input_processor
        copy.deepcopy(self.sampling_params(req)).verify(
            proc.model_config, proc.speculative_config, proc.structured_outputs_config, proc.tokenizer
        )

    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        from vllm import TokensPrompt

        assert self.engine is not None, "engine not started"
        params = self.sampling_params(req)
        prompt = TokensPrompt(prompt_token_ids=req.prompt_token_ids)
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt
        first, entered = True, time.monotonic()
        # getattr: a request pickled by an ingress of a version before has no tenant or share (engine/types.py)
        tenant, share = getattr(req, "tenant", None), getattr(req, "share", 1)
        priority, start = self.fair.tag(tenant, req.priority, share) if self.fair is not None else (req.priority, 0)
        outputs = self.engine.generate(prompt, params, req.request_id, priority=priority)
        try:
            async for out in outputs:
                comp = out.outputs[0]
                chunk = EngineChunk(
                    text=comp.text,
                    token_ids=list(comp.token_ids),
                    finish_reason=comp.finish_reason if out.finished else None,
                    stop_reason=comp.stop_reason if out.finished else None,
                )
                if first:
                    if self.fair is not None:
                        self.fair.started(start)
                    chunk.num_cached_tokens = out.num_cached_tokens or 0
                    chunk.engine_ms = first_chunk_ms(entered, out.metrics, time.monotonic())
                    first = False
                yield chunk
        finally:
            # A consumer that stops early (the client went away) aborts the request in AsyncLLM now, which frees
            # its KV blocks, rather than whenever the abandoned generator is finalized.
            await outputs.aclose()

    async def num_unfinished(self) -> int:
        assert self.engine is not None
        proc = self.engine.output_processor
        return proc.get_num_unfinished_requests()

    async def check_health(self) -> None:
        assert self.engine is not None
        await self.engine.check_health()

    @property
    def dead(self) -> bool:
        """The engine core is gone (exited or failed; vLLM's AsyncLLM then fails every request): nothing this
        engine can serve until it is replaced."""
        return self.engine is None or self.engine.errored

    def shutdown(self) -> None:
        if self.engine is not None:
            # vLLM gives EngineCore 5 s after SIGTERM before it kills it, and on a CPU it takes them all: its worker's
            # and its own final garbage collection over the model's objects (py-spy). A CPU has no device state to
            # release properly, so EngineCore gets 1 s there (its worker exits on its own when its parent is gone);
            # a GPU keeps vLLM's grace.
            self.engine.shutdown(timeout=_CPU_STOP_GRACE_S if _on_cpu_platform() else None)
            self.engine = None
