"""Settings: one object, built once at start-up and passed explicitly.

Precedence, highest first: CLI flags, CLAIRVOYANT_* environment variables (in any case), the
optional TOML config file (``--config`` or CLAIRVOYANT_CONFIG), defaults. They are pydantic-settings'
own init, environment and TOML sources, ordered in ``Settings.settings_customise_sources``. An
invalid value stops start-up with a ``ConfigError`` naming the setting and where its value came
from (flag, environment variable as spelled, or config file and key); an unknown config-file key
stops it too, naming the closest valid key. An unknown ``CLAIRVOYANT_*`` environment variable is
logged as a WARNING with the closest valid name, and start-up goes on.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import tomllib
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from clairvoyant.errors import ConfigError
from clairvoyant.scheduling.policy import POLICY_NAMES

__all__ = [
    "ApiKey",
    "CLI_FLAGS",
    "Limits",
    "Tenant",
    "ENV_PREFIX",
    "Settings",
    "load_settings",
    "read_api_keys_file",
    "unknown_environment_variables",
]

logger = logging.getLogger(__name__)

ENV_PREFIX = "CLAIRVOYANT_"
DisconnectMode = Literal["auto", "drain", "abort"]


# Settings that `clairvoyant serve` also takes as command-line flags (they override everything).
CLI_FLAGS: dict[str, str] = {
    "host": "--host",
    "port": "--port",
    "upstream_url": "--upstream",
    "backends": "--backend",
    "policy": "--policy",
    "starvation_timeout_s": "--tau",
    "starvation_slowdown": "--slowdown",
    "slots": "--slots",
    "max_queue": "--max-queue",
    "disconnect_mode": "--disconnect-mode",
    "model_path": "--predictor",  # `serve --model` still works, with a warning (proxy/serve.py)
    "log_level": "--log-level",
    "learner_state_path": "--learner-state",
    "redis_url": "--redis",
    "cluster_name": "--cluster",
    "replica_id": "--replica-id",
    "lease_s": "--lease-s",
    "redis_fallback": "--redis-fallback",
}


class Limits(BaseModel):
    """What one tenant may use at most (unset: no bound). Counted on the scheduled endpoints only."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    max_concurrent: int | None = Field(None, ge=1)
    """Requests in flight plus waiting, at most."""
    requests_per_minute: int | None = Field(None, ge=1)
    """Requests admitted in any sliding 60 s, at most."""
    tokens_per_day: int | None = Field(None, ge=1)
    """Completion tokens per UTC day, as the backend reported them, at most."""

    @property
    def bounded(self) -> bool:
        return any(v is not None for v in (self.max_concurrent, self.requests_per_minute, self.tokens_per_day))


class ApiKey(Limits):
    """One client API key, stored only as its hash (``clairvoyant keys add`` makes one), with its
    tenant's limits."""

    hash: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    """sha256:<hex> of the key's text"""
    tenant: str = Field(min_length=1, max_length=128)
    """The tenant its requests belong to (fair share)."""
    min_priority: int = 0
    """Most urgent priority this key may ask for."""
    max_priority: int = 10
    """Least urgent priority this key may ask for."""
    weight: float = Field(1.0, gt=0)
    """The tenant's fair-share weight (2 = twice the backend seconds of weight 1)."""

    @model_validator(mode="after")
    def _check_range(self) -> ApiKey:
        if self.min_priority > self.max_priority:
            raise ValueError("min_priority must be <= max_priority")
        return self


class Tenant(Limits):
    """A tenant named by the tenant header (``[[tenants]]``): its fair-share weight and limits."""

    name: str = Field(min_length=1, max_length=128)
    """The tenant header's value."""
    weight: float = Field(1.0, gt=0)
    """Fair-share weight (2 = twice the backend seconds of weight 1)."""


def http_url(value: str) -> str:
    """A backend's base URL: http(s), without a trailing slash, and without an API's own path (the
    proxy forwards each request's path, /v1/... or /api/..., as the client sent it)."""
    if not value.startswith(("http://", "https://")):
        raise ValueError("must start with http:// or https://")
    base = value.rstrip("/")
    path = urlsplit(base).path
    for api in ("/v1", "/api"):
        if path == api or path.endswith(api) or f"{api}/" in path:
            fix = base[: base.index(api, len(base) - len(path))]
            raise ValueError(
                f"{value!r} ends in an API path ({api}): give the server's base URL, {fix!r}; the proxy forwards each "
                f"request's own path ({api}/...)"
            )
    return base


# proxy/backend_kinds.py holds what each kind is
BackendKindName = Literal["auto", "ollama", "llamacpp", "openai", "vllm"]


class BackendConfig(BaseModel):
    """One backend of the pool (``[[backends]]``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    url: str
    """Base URL, e.g. http://127.0.0.1:11434 (user:password@ allowed; never logged)."""
    name: str | None = Field(None, max_length=64)
    """Shown in /queue, /readyz, metrics and the X-Clairvoyant-Backend header; default backend-N (its place in the list,
    from 1: names reach clients, addresses must not)."""
    kind: BackendKindName = "auto"
    """ollama, llamacpp, openai or vllm; auto = asked at start-up."""
    slots: int | None = Field(None, ge=1, le=256)
    """Requests it runs at once; unset = llama.cpp's /props total_slots, else `slots`."""
    models: list[str] = Field(default_factory=list)
    """Models it serves; empty = any model."""
    api_key: SecretStr | None = None
    """Its own key, sent as Authorization: Bearer; never logged."""

    _check_url = field_validator("url")(http_url)


class Settings(BaseSettings):
    """Every setting of the proxy. docs/configuration.md is generated from this class."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", validate_default=True, use_attribute_docstrings=True
    )

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = Field(8080, ge=0, le=65535)
    """Port to listen on."""
    upstream_url: str = "http://127.0.0.1:11434"
    """Base URL of the backend (Ollama or llama.cpp's server): the one-backend shorthand of `backends`."""
    backends: list[BackendConfig] = Field(default_factory=list)
    """A pool of backends as [[backends]] tables (url, name, kind, slots, models, api_key) or a JSON list; requests are
    routed at dispatch by model, loaded model and predicted work; empty = upstream_url."""
    vllm_priority: bool = False
    """Send vLLM backends each request's computed priority (its 'priority' field: client class, then predicted tokens)
    so the engine orders its own batch queue by it; needs vLLM's --scheduling-policy priority."""
    policy: str = Field(
        "sjf",
        description=(
            "Scheduling policy: " + ", ".join(POLICY_NAMES) + " (fcfs arrival order; sjf the paper's shortest "
            "predicted first; boost gamma-boost; hrrn highest response ratio next). See docs/simulation.md."
        ),
    )
    starvation_timeout_s: float = Field(1.0, gt=0)
    """tau: a request waiting longer than tau + starvation_slowdown x its predicted seconds goes before every later
    arrival, whatever the policy or priority ('inf' disables)."""
    starvation_slowdown: float = Field(2.56, ge=0)
    """Adds this many times a request's predicted service seconds to its tau (0 = the paper's rule); with
    starvation_slowdown_adaptive, times (1 + CV^2) of recent service times. See docs/scheduling.md."""
    starvation_slowdown_adaptive: bool = True
    """Scale the slowdown by (1 + CV^2) of the last 512 measured service times (CV^2 = 0.25 until 20 are in)."""
    boost_gamma_per_s: float = Field(0.02, gt=0)
    """boost: gamma in 1/s; requests shorter than about 1/gamma seconds get a real boost."""
    boost_auto_gamma: bool = False
    """boost: fit gamma online by the fixed-point rule (manual gamma until it has a root)."""
    boost_max_s: float = Field(600.0, gt=0)
    """boost: cap on any boost, seconds; within a priority class no later arrival passes a request after this."""
    fair_share: bool = True
    """Share the backend between tenants by predicted service seconds."""
    model_switch_bound_s: float = Field(30.0, ge=0)
    """Model affinity, seconds: a backend that loads models on demand (Ollama, llama-swap) serves the model it holds
    while that is worth more than a load (predicted seconds of what waits, on both sides) and no request for another
    model has been put off this long (waiting since it arrived, or since the backend's last switch), then switches to
    the model put off longest; a request for a model not held is charged its learned load. 0 = off (switching counted as
    free); fcfs ignores it. See docs/scheduling.md."""
    tenant_header: str = "X-Clairvoyant-Tenant"
    """Request header naming the tenant (absent = the default tenant)."""
    priority_header: str = "X-Clairvoyant-Priority"
    """Request header with an integer priority (the body field 'priority' wins)."""
    min_priority: int = 0
    """Most urgent priority a client may ask for (lower = sooner); lower values are clamped."""
    max_priority: int = 10
    """Least urgent priority a client may ask for; higher values are clamped."""
    forward_priority: bool = False
    """Keep the body's 'priority' field when forwarding (vLLM accepts it)."""
    service_time_state: Path | None = None
    """JSON file where the learned service-time model is kept across restarts; unset = beside learner_state_path
    (<stem>.service-time.json) when that is set, else memory only."""
    slots: int = Field(1, ge=1, le=64)
    """Requests in flight upstream at once (the backend's parallel slots)."""
    max_queue: int = Field(256, ge=1)
    """Waiting requests before new ones get 503 with Retry-After."""
    retry_after_s: int = Field(1, ge=1)
    """Smallest Retry-After seconds sent with a queue-full 503 (the value is the queue tail's ETA)."""
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """Largest request body accepted (413 above)."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """Seconds for the backend to accept a connection. Not accepted in time is a 504 (refused is a 502); nothing was
    sent, so the request first waits for the backend (backend_wait_s)."""
    first_byte_timeout_s: float = Field(600.0, gt=0)
    """Seconds from sending a request until the backend's response headers (504 beyond). Covers a cold model load; a
    NON-streamed answer's headers come only when it is fully generated, so this also bounds it."""
    read_timeout_s: float | None = Field(None, gt=0)
    """Timeout between bytes from the backend once it answers; unset = none (long answers take minutes)."""
    backend_keepalive_s: float = Field(60.0, ge=0)
    """TCP keepalive on backend connections, seconds idle before the first probe (then 4 probes, this / 4 apart), and
    twice this for request bytes left unacknowledged: a backend whose host vanished mid-answer (powered off, off the
    network) is found gone after about twice this, and the answer ends with the dialect's error instead of hanging
    (read_timeout_s is unset by default). A backend that is there answers the probes, however long it generates. 0 = the
    system's defaults (hours)."""
    backend_wait_s: float = Field(30.0, ge=0)
    """A request not yet sent whose backend is down (connection refused or not accepted, or 503 while a model loads) or
    suspect (it let a first-byte deadline pass) waits this long from the outage's start for its health check, then gets
    502 (refused), 504 (not accepted), the backend's 503, or 503 with Retry-After (suspect: never sent into a hang). In
    all at most the larger of this and connect_timeout_s, plus 0.5 s."""
    disconnect_mode: DisconnectMode = "auto"
    """When a client leaves mid-generation: abort the upstream request, drain it to its end, or auto: abort, and for a
    non-streamed request hold the slot until llama.cpp's /slots shows the backend idle (llama.cpp does not always stop
    one). See docs/design.md."""
    client_timeout_s: float = Field(30.0, gt=0)
    """A client must send its request headers within this many seconds of connecting (or of its previous answer, on a
    kept-alive connection: an idle connection closes then), and then its body within as many again (408)."""
    max_header_bytes: int = Field(64 * 1024, ge=8192)  # the least the server's HTTP/1.1 parser (hyper) accepts
    """Largest request line + headers accepted, bytes (431 beyond)."""
    max_connections: int = Field(2048, ge=1)
    """Requests the server handles at once (waiting ones included); a connection beyond it waits to be accepted until
    one ends. Set it above max_queue + slots."""
    body_budget_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    """Bytes of request bodies the proxy holds at once (being read or waiting in the queue); a body that does not fit
    gets 503 with Retry-After."""
    shutdown_grace_s: float = Field(8.0, ge=0)
    """On SIGTERM: queued requests get 503 at once; in-flight answers may finish for this many seconds, then end with an
    error event. (docker stop waits 10 s before SIGKILL.)"""
    api_keys: list[ApiKey] = Field(default_factory=list)
    """Client API keys as [[api_keys]] tables (hash, tenant, min_priority, max_priority, weight); none = no
    authentication (the localhost default). Make one with `clairvoyant keys add`."""
    api_keys_file: Path | None = None
    """A TOML file holding only [[api_keys]] tables, which `clairvoyant keys add` appends to; its keys join api_keys.
    Read again on SIGHUP. In the config file, a relative path is from the file's folder."""
    tenants: list[Tenant] = Field(default_factory=list)
    """Tenants named by the tenant header, as [[tenants]] tables (name, weight, max_concurrent, requests_per_minute,
    tokens_per_day). A key's tenant takes the key's limits."""
    default_queue_deadline_s: float | None = Field(None, gt=0)
    """Seconds a scheduled request may wait before it is sent, when it does not say (X-Clairvoyant-Deadline); beyond it,
    503 queue_deadline and never sent. Unset = no deadline."""
    max_generation_s: float | None = Field(None, gt=0)
    """Seconds a scheduled answer may run once sent; a longer one ends with the dialect's error. Unset = no bound."""
    supersede_running: bool = False
    """X-Clairvoyant-Supersede also aborts a running request with the same key (as a client that left would), not only a
    waiting one."""
    redis_url: SecretStr | None = None
    """Share the queue, the slots, the tenants' limits and what is learned with every replica naming the same Redis and
    cluster, e.g. redis://127.0.0.1:6379/0 (a password in it is never logged); unset = this process schedules alone.
    Only metadata goes to Redis, never prompt or answer text."""
    cluster_name: str = Field("clairvoyant", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """With redis_url: the replicas that share one queue name the same cluster (two deployments may share one Redis
    under two names)."""
    replica_id: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    """With redis_url: this replica's name in /queue, the metrics' replica label and the logs; unset = host name and
    port."""
    lease_s: float = Field(15.0, ge=1.0, le=300.0)
    """With redis_url: seconds a granted slot stays held without a renewal (replicas renew every second); a replica that
    dies gives its slots back within this, and one that cannot renew stops the answers it relays rather than run beyond
    the slot count. Also the pause after Redis restarts empty."""
    redis_fallback: bool = False
    """With redis_url: start on local scheduling when Redis is unreachable at start-up (a share of each backend's
    slots), and join when it answers; off = such a start-up fails with exit code 2."""
    status_requires_key: bool = False
    """With api_keys: the proxy's data (GET /queue, /queue/{id}, /metrics and /history) needs a key too. /healthz,
    /readyz and the live page's files (/ui, /ui/) stay open: they hold no data, and the page asks for the key."""
    forward_client_key: bool = False
    """With api_keys: forward the client's Authorization / X-Api-Key header to the backend."""
    upstream_api_key: SecretStr | None = None
    """The backend's own key (llama-server --api-key), sent as Authorization: Bearer; never logged."""
    passthrough_allow: list[str] | None = None
    """Pass-through paths allowed, as 'METHOD /path' or 'METHOD /prefix/*' ('*' = all); unset = all on loopback, else
    inference, model listing and show only (no pull, push, create, copy, delete)."""
    model_path: Path | None = None
    """ONNX predictor model (its .card.json beside it); unset = shipped model."""
    encoder: bool = True
    """Refine the prediction of a request that waits with the shipped MiniLM encoder, on one background thread
    (milliseconds per request; a request that finds a free slot is never refined; the learner's encodes of completed
    requests take at most a quarter of that thread). Off: lexical only."""
    encoder_path: Path | None = None
    """The encoder's card (encoder.card.json, its files beside it); unset = the shipped encoder."""
    encoder_max_pending: int = Field(256, ge=1)
    """Waiting requests queued for the encoder at most; beyond it they keep the lexical one."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level."""
    log_format: Literal["text", "json"] = "text"
    """Log lines as text (key=value fields) or JSON (one object a line, for Loki or Elastic)."""
    log_prompts: bool = False
    """Log prompt text (debug aid; off by default)."""
    allow_oracle: bool = False
    """Benchmarks only: accept the true output length in the request's 'clairvoyant' field."""
    bench_upstream_fields: bool = False
    """Benchmarks only: add the request's 'clairvoyant.proxy.upstream' fields to the body sent to the backend after
    prediction (a forced answer length the predictor must not see as a cap)."""
    online_learning: bool = True
    """Learn this deployment's answer lengths from the backend's counts and correct the predictor (off: the static
    model, whose quality /metrics still shows)."""
    learner_state_path: Path | None = None
    """File the online learner loads at start and saves to (atomically); unset = learn in memory only."""
    learner_save_interval_s: float = Field(300.0, gt=0)
    """Seconds between saves of the learner's state (it is also saved at shutdown)."""
    learner_max_observations_per_s: float = Field(10.0, gt=0)
    """Completed requests the online learner takes per second on average at most (bursts of ten seconds' worth); a
    faster flow is sampled. It keeps the last 1,024 per model and refits at most once a second, so more would add
    little, and each costs the request path and the encoder's thread (milliseconds)."""

    _check_url = field_validator("upstream_url")(http_url)

    @model_validator(mode="after")
    def _add_keys_from_file(self) -> Settings:
        """The keys of ``api_keys_file`` after those of ``api_keys`` (an entry already there, as in a
        copy of settings that read the file, is not added twice)."""
        if self.api_keys_file is not None:
            self.api_keys = [
                *self.api_keys,
                *(k for k in read_api_keys_file(self.api_keys_file) if k not in self.api_keys),
            ]
        return self

    @model_validator(mode="after")
    def _check_priority_range(self) -> Settings:
        if self.min_priority > self.max_priority:
            raise ValueError("min_priority must be <= max_priority")
        return self

    def _limit_entries(self) -> list[tuple[str, Limits]]:
        """(tenant, its limits) from every key and [[tenants]] entry that bounds something."""
        entries = [(key.tenant, key) for key in self.api_keys] + [(tenant.name, tenant) for tenant in self.tenants]
        limits = [(name, Limits(**{f: getattr(e, f) for f in Limits.model_fields})) for name, e in entries]
        return [(name, bounds) for name, bounds in limits if bounds.bounded]

    @model_validator(mode="after")
    def _check_tenants(self) -> Settings:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenants must have distinct names")
        seen: dict[str, Limits] = {}
        for name, limits in self._limit_entries():
            if seen.setdefault(name, limits) != limits:
                raise ValueError(f"tenant {name!r} is given two different sets of limits")
        return self

    @property
    def tenant_limits(self) -> dict[str, Limits]:
        """Each bounded tenant's limits (from its keys, or its [[tenants]] entry)."""
        return dict(self._limit_entries())

    @property
    def tenant_weights(self) -> dict[str, float]:
        """Fair-share weights by tenant: its keys', or its [[tenants]] entry's."""
        return {**{t.name: t.weight for t in self.tenants}, **{k.tenant: k.weight for k in self.api_keys}}

    @model_validator(mode="after")
    def _check_backend_names(self) -> Settings:
        names = [b.name for b in self.pool]
        if len(set(names)) != len(names):
            raise ValueError("backends must have distinct names")
        return self

    @property
    def pool(self) -> list[BackendConfig]:
        """The backends: ``backends``, or ``upstream_url`` (with ``upstream_api_key`` and ``slots``) alone."""
        if self.backends:
            return [
                b if b.name else b.model_copy(update={"name": f"backend-{i}"}) for i, b in enumerate(self.backends, 1)
            ]
        return [BackendConfig(url=self.upstream_url, name="backend-1", slots=self.slots, api_key=self.upstream_api_key)]

    @property
    def service_time_path(self) -> Path | None:
        """Where the service-time model is kept: its own setting, else beside the learner's state."""
        if self.service_time_state is not None:
            return self.service_time_state
        if self.learner_state_path is not None:
            return self.learner_state_path.with_name(self.learner_state_path.stem + ".service-time.json")
        return None

    @field_validator("policy")
    @classmethod
    def _check_policy(cls, value: str) -> str:
        if value not in POLICY_NAMES:
            raise ValueError(f"unknown policy {value!r}; known: {', '.join(POLICY_NAMES)}")
        return value

    @field_validator("model_switch_bound_s")
    @classmethod
    def _check_switch_bound(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number of seconds (a switch may not be put off forever); 0 = off")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Highest first: CLI flags (init), the environment, the config file (set by load_settings).
        config_file = _config_file.get()
        return (init_settings, env_settings) if config_file is None else (init_settings, env_settings, config_file)


# Settings that no longer have any effect: accepted with a WARNING, so that an older config file
# still starts (name -> why).
RETIRED_SETTINGS: dict[str, str] = {
    "keep_alive_timeout_s": "an idle kept-alive connection now closes after client_timeout_s",
    "client_keepalive_s": "the server does not set TCP keepalive on client connections",
    "park_waiting": "a waiting request is a coroutine; there is nothing to park",
}

# CLAIRVOYANT_* variables that are not settings but are read on purpose (the config file's path;
# the test suite's switch that turns a missing llama.cpp backend into a failure; `clairvoyant status`'s key).
OTHER_ENV_NAMES = frozenset({f"{ENV_PREFIX}CONFIG", f"{ENV_PREFIX}REQUIRE_BACKEND", f"{ENV_PREFIX}STATUS_KEY"})


def _did_you_mean(name: str, candidates: Iterable[str], prefix: str = "") -> str:
    """A hint naming the candidate most like ``name`` (difflib), or "" when nothing is close."""
    matches = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{matches[0]}?" if matches else ""


def unknown_environment_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One message per ``CLAIRVOYANT_*`` variable that is neither a setting nor read elsewhere,
    naming the closest valid variable. Start-up logs them and goes on (a typo must not stop a
    service, but it must not pass in silence either)."""
    environ = os.environ if environ is None else environ
    valid = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields} | OTHER_ENV_NAMES
    retired = {f"{ENV_PREFIX}{name.upper()}": name for name in RETIRED_SETTINGS}
    # Compared without the shared prefix (it would make every name look alike), upper-cased because
    # pydantic-settings reads the environment case-insensitively.
    suffixes = [name.removeprefix(ENV_PREFIX) for name in valid]
    messages = []
    for key in sorted(environ):
        upper = key.upper()
        if upper in retired:
            messages.append(f"{key} has no effect any more ({RETIRED_SETTINGS[retired[upper]]})")
        elif upper.startswith(ENV_PREFIX) and upper not in valid:
            hint = _did_you_mean(upper.removeprefix(ENV_PREFIX), suffixes, ENV_PREFIX)
            messages.append(f"unknown environment variable {key} (ignored){hint}")
    return messages


def _environment_name(name: str) -> str | None:
    """The variable that sets ``name`` as it is spelled in the environment (any case, as
    pydantic-settings reads it), or None."""
    wanted = f"{ENV_PREFIX}{name}".upper()
    return next((key for key in os.environ if key.upper() == wanted), None)


def read_api_keys_file(path: Path) -> list[ApiKey]:
    """The ``[[api_keys]]`` tables of an ``api_keys_file``: a file of keys and nothing else, so that
    appending to it (``clairvoyant keys add >> FILE``) never puts a setting inside a table."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"api_keys_file {path} cannot be read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"api_keys_file {path} is not valid TOML: {exc}") from None
    others = sorted(set(data) - {"api_keys"})
    if others:
        raise ValueError(f"api_keys_file {path} holds {others[0]!r}: it may hold only [[api_keys]] tables")
    keys = []
    for number, entry in enumerate(data.get("api_keys", []), start=1):
        try:
            keys.append(ApiKey.model_validate(entry))
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'entry'}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"api_keys_file {path}, [[api_keys]] table {number}: {problems}") from None
    return keys


# The arrays of tables a config file may hold, by setting, with the model of one table.
_TABLE_MODELS: dict[str, type[BaseModel]] = {"api_keys": ApiKey, "tenants": Tenant, "backends": BackendConfig}


def _settings_inside_tables(path: Path, data: Mapping[str, Any]) -> list[str]:
    """One message per setting that sits inside a ``[[table]]``: TOML gives every line after a
    table header to that table, so a setting appended to a file that ends with one lands in it."""
    messages = []
    for name, model in _TABLE_MODELS.items():
        entries = data.get(name)
        tables = [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
        hint = "; keep the keys in api_keys_file, which `clairvoyant keys add` appends to" if name == "api_keys" else ""
        for key in sorted(
            {k for table in tables for k in table if k in Settings.model_fields} - set(model.model_fields)
        ):
            messages.append(
                f"config file {path}: the setting {key!r} is inside a [[{name}]] table (a line after a table's "
                f"header belongs to the table): move it above the first [[...]] header{hint}"
            )
    return messages


class ConfigFileSource(TomlConfigSettingsSource):
    """The TOML config file: pydantic-settings' TOML source, made strict. A missing file, invalid
    TOML or an unknown key raises ``ConfigError`` naming the file (and the closest valid key); a
    retired key is dropped with a WARNING."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path) -> None:
        if not path.is_file():  # the library skips a missing file; one named on purpose must exist
            raise ConfigError(f"config file {path} not found")
        super().__init__(settings_cls, toml_file=path)

    def _read_file(self, file_path: Path | Traversable) -> dict[str, Any]:
        try:
            data = super()._read_file(file_path)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file_path} is not valid TOML: {exc}") from None
        stray = _settings_inside_tables(Path(str(file_path)), data)
        if stray:
            raise ConfigError("; ".join(stray))
        if isinstance(data.get("api_keys_file"), str):  # relative to the file that names it, not the working folder
            data["api_keys_file"] = str(Path(str(file_path)).parent / data["api_keys_file"])
        for key in sorted(set(data) & set(RETIRED_SETTINGS)):
            logger.warning("config file %s: %s has no effect any more (%s)", file_path, key, RETIRED_SETTINGS[key])
            del data[key]
        unknown = [
            f"config file {file_path}: unknown setting {key!r}{_did_you_mean(key, Settings.model_fields)}"
            for key in sorted(set(data) - set(Settings.model_fields))
        ]
        if unknown:
            raise ConfigError("; ".join(unknown))
        return data


# The config file of the load_settings call under way: pydantic-settings builds its sources in a
# classmethod, which sees no per-call arguments, and the file is chosen per call (--config).
_config_file: ContextVar[ConfigFileSource | None] = ContextVar("clairvoyant_config_file", default=None)


def _origin(name: str, flags: Mapping[str, Any], config_file: ConfigFileSource | None) -> str:
    """Where the value of setting ``name`` came from, highest source first."""
    if name in flags:
        return f"flag {CLI_FLAGS[name]}" if name in CLI_FLAGS else f"argument {name}"
    variable = _environment_name(name)
    if variable is not None:
        return variable
    if config_file is not None and name in config_file.toml_data:
        return f"config file {config_file.toml_file_path}, key {name}"
    return "the default"


def _describe(error: ValidationError, flags: Mapping[str, Any], config_file: ConfigFileSource | None) -> str:
    """One line per invalid setting, blaming where its value came from."""
    lines = []
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"]) or "settings"
        named = str(item["msg"]).removeprefix("Value error, ").split(" ", 1)[0]
        if not item["loc"] and named in Settings.model_fields:  # a check of one setting made once all were read
            field = named
        top = field.split(".", 1)[0]
        origin = _origin(top, flags, config_file) if top in Settings.model_fields else "the combination of settings"
        lines.append(f"invalid setting {field} ({origin}): {item['msg']}")
    return "; ".join(lines)


def load_settings(config_file: Path | str | None = None, **overrides: Any) -> Settings:
    """Build the Settings. ``overrides`` are CLI flags; None values mean "not given".

    Logs a WARNING for each unknown ``CLAIRVOYANT_*`` environment variable (and starts anyway);
    raises ``ConfigError`` for an unknown config-file key or an invalid value, naming where the
    value came from (flag, environment variable, or config file and key).
    """
    for message in unknown_environment_variables():
        logger.warning("%s", message)
    if config_file is None:
        variable = _environment_name("config")
        config_file = (os.environ[variable] or None) if variable else None
    file_source = ConfigFileSource(Settings, Path(config_file)) if config_file else None
    flags = {k: v for k, v in overrides.items() if v is not None}
    token = _config_file.set(file_source)
    try:
        return Settings(**flags)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, flags, file_source)) from None
    finally:
        _config_file.reset(token)
