"""The fleet file: which replicas exist, where they are, and how the router treats them.

One YAML file is read by the router (`gorgo extproc`), the Envoy config renderer and the simulated
fleet launcher, so all three always agree on names, clusters and addresses. Validation is strict:
an unknown or mistyped field is an error that names its path, because a silently ignored typo in a
router config shows up much later as bad routing.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, urlsplit

import yaml

from gorgo.core.block_hashes import DEFAULT_SEED
from gorgo.core.contract import API_PATHS, HEALTH_PATH, RESERVED_CLUSTERS, WEIGHT_BOUNDS
from gorgo.core.decimals import whole_number
from gorgo.core.terms import BY_NAME, OBJECTIVES, TTFT
from gorgo.core.weights import Weights
from gorgo.errors import MAX_PORT, UserError

ENGINE_KINDS = ("sglang", "vllm", "sim")
DEFAULT_PROFILE = "h100-llama3-8b"
LINK_PRESETS: dict[str, tuple[float, float]] = {
    # GORGO paper's measured RTTs from a us-east proxy: (mean ms, sd ms).
    "us-east": (37.0, 8.0),
    "eu-frankfurt": (279.0, 80.0),
    "ap-seoul": (456.0, 138.0),
    "local": (1.0, 0.2),
}


class FleetError(UserError, ValueError):
    """A fleet file problem; the message starts with the path of the offending field."""


@dataclass(frozen=True, slots=True)
class RegionSpec:
    name: str
    rtt_ms: float  # emulated link RTT (regions.<name>.sim; the router measures its own)
    jitter_ms: float


@dataclass(frozen=True, slots=True)
class SimEngineSpec:
    profile: str = DEFAULT_PROFILE
    flavor: str = "sglang"
    port: int = 0  # engine port behind the link emulator; 0 = pick one
    speed: float = 1.0  # relative GPU speed (0.5 = a GPU half as fast as the profile's)
    kv_tokens: int = 0  # KV pool in tokens; 0 = the profile's (smaller: cache pressure)


APPROXIMATE, PRECISE = "approximate", "precise"
CACHE_MODES = (APPROXIMATE, PRECISE)


@dataclass(frozen=True, slots=True)
class KVEventsSpec:
    """Where a replica's engine publishes KV events (vLLM's --kv-events-config); without it the
    router asks the engine's /kv_event_sources."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


@dataclass(frozen=True, slots=True)
class PreciseSpec:
    """A `cache: precise` replica: its served model's tokenizer (a local directory, or ``sim``)
    and the engine's block-hash seed (its PYTHONHASHSEED, when set)."""

    tokenizer: str
    hash_seed: str = DEFAULT_SEED
    kv_events: KVEventsSpec | None = None


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    name: str
    region: str
    cluster: str
    address: str  # host:port that Envoy and the router's probes connect to
    engine: str
    health_url: str
    metrics_url: str
    prefill_rate: float  # tokens/s, a hint the tuner refines
    kv_capacity_tokens: int
    sim: SimEngineSpec | None = None
    cache: str = APPROXIMATE  # the router's view of its KV cache (gorgo.core.precise)
    precise: PreciseSpec | None = None  # set exactly when cache is precise
    # The model names it serves (empty: whatever is asked); aliases are further names its engine
    # answers to (vLLM's several --served-model-name), selecting the same replicas.
    models: tuple[str, ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()  # (alias, model)
    drain: bool = False  # routable for no new request; its open streams finish
    # Cost-term constants for this replica's engine, (term, param, value), e.g. ("admission",
    # "max_running", 64.0); the rest stay at the term's defaults (FleetState.params).
    params: tuple[tuple[str, str, float], ...] = ()

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may ask this replica for: its models, then their aliases."""
        return (*self.models, *(a for a, _ in self.aliases))

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @property
    def metrics_flavor(self) -> str:
        return self.sim.flavor if self.sim is not None else self.engine


# A section field's bounds beyond ">= 0", as keyword arguments of `_num` (`_section` reads them).
POSITIVE = {"strict": True}  # 0 would time out at once, or spin a loop
# Envoy's longest timeout (INT64_MAX nanoseconds): a timeout past it was refused by Envoy naming
# its own field, not the fleet's.
ENVOY_MAX_S = 9_223_372_035
ENVOY_LEAST_FLUSH_S = 0.001  # access_log_flush_interval's least value (HcmAccessLogOptions)
SECONDS = {"strict": True, "maximum": ENVOY_MAX_S}
MILLISECONDS = {"strict": True, "maximum": ENVOY_MAX_S * 1000}


@dataclass(frozen=True, slots=True)
class Timeouts:
    # Envoy's ext_proc message_timeout, which it bounds at an hour
    message_ms: int = field(default=1000, metadata={"strict": True, "maximum": 3_600_000})
    connect_ms: int = field(default=2000, metadata=MILLISECONDS)
    # a whole request, stream included (Envoy route timeout); 0 is no "no timeout" here: the
    # tuner's range, a peer booking's life and a held booking all end at it
    request_s: float = field(default=600.0, metadata=SECONDS)
    # no byte either way for this long ends a stream (non-streamed: request_s); 0: never
    idle_s: float = field(default=60.0, metadata={"maximum": ENVOY_MAX_S})
    probe_ms: int = field(default=2000, metadata=MILLISECONDS)


@dataclass(frozen=True, slots=True)
class Signals:
    probe_interval_s: float = field(default=2.0, metadata=POSITIVE)
    scrape_interval_s: float = field(default=1.0, metadata=POSITIVE)
    metrics_stale_s: float = field(default=5.0, metadata=POSITIVE)
    # the new sample's share of the RTT average: above 1 would extrapolate (a negative RTT)
    rtt_ewma_alpha: float = field(default=0.3, metadata={"strict": True, "maximum": 1.0})


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may cost the router: each bound is checked while the body is parsed,
    before the per-element work it bounds, so a cheap body cannot buy seconds of the event loop."""

    max_body_bytes: int = 8 * 1024 * 1024
    max_json_depth: int = 64
    max_json_containers: int = 50_000  # objects and arrays in the whole body
    max_messages: int = 4096  # also a completions prompt's list of strings
    max_content_parts: int = 1024  # per message: content parts, and tool calls
    max_tools: int = 512
    max_prompt_chars: int = 8 * 1024 * 1024  # the prompt as hashed (tool definitions included)
    max_output_tokens: int = 1024 * 1024  # max_tokens and its aliases
    max_choices: int = 128  # `n`: the completions one request asks for (per prompt)
    # `cache: precise` lookups: tokens tokenized or hashed afresh (no memo holds them) on the
    # request path per lookup; beyond, the engine's chain of blocks (gorgo.core.precise)
    precise_lookup_tokens: int = 256


@dataclass(frozen=True, slots=True)
class Shedding:
    """Admission control: shed a request when even its best replica's predicted TTFT exceeds
    ``slo_ms * (1 + priority_step * priority)``; 0 disables. Priority 0 is shed first."""

    slo_ms: float = 0.0
    default_priority: int = 1
    priority_step: float = 0.5


@dataclass(frozen=True, slots=True)
class Slo:
    """Default latency targets of the `slo` objective (a request's trusted x-slo-ttft-ms and
    x-slo-tpot-ms headers override them); 0 is no target."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Penalties:
    """Anomaly penalty: ``error_ms`` is added to a replica's cost per failed response and decays
    with ``half_life_s``, as does any penalty the tuner publishes."""

    error_ms: float = 1000.0
    half_life_s: float = field(default=10.0, metadata=POSITIVE)  # 0: a 0/0 decay


# Envoy's bounds for a cluster's `preconnect_policy.per_upstream_preconnect_ratio`.
PRECONNECT_RATIO_MAX = 3.0


@dataclass(frozen=True, slots=True)
class Upstream:
    """How Envoy holds its connections to the replicas. HTTP/1.1 (what vLLM and SGLang serve)
    carries one stream per connection, so a request that finds no idle connection to its
    replica waits a handshake first: one more round trip to a far region. With
    ``preconnect_ratio`` r, Envoy keeps r connections to a replica per stream it has open
    there (Envoy's `per_upstream_preconnect_ratio`), opened before the requests that will need
    them; 1 opens a connection only when a request needs one."""

    preconnect_ratio: float = field(default=2.0, metadata={"minimum": 1.0,
                                                           "maximum": PRECONNECT_RATIO_MAX})


@dataclass(frozen=True, slots=True)
class Retries:
    """Envoy retries a failed attempt (connect failure, reset or 503 before any response byte)
    once, on the decision's next-best replica, while retries in flight stay within
    ``budget_percent`` of active requests (at least ``min_retry_concurrency``)."""

    enabled: bool = True
    budget_percent: float = 20.0
    min_retry_concurrency: int = 3


@dataclass(frozen=True, slots=True)
class Observability:
    """What Envoy records besides spans: with ``access_log``, one JSON line per request (decision
    id, replica, first byte, status; never the prompt) to ``access_log_path``."""

    access_log: bool = False
    access_log_path: str = "/dev/stdout"
    # With a tuner (OTLP), Envoy's periodic access log sends each open stream's first-token time
    # this often, so the tuner need not wait for the stream's end; 0 turns it off.
    ttft_log_interval_s: float = 0.5


@dataclass(frozen=True, slots=True)
class Routes:
    """Exact paths Envoy forwards besides the inference API and the health path
    (contract.API_PATHS, HEALTH_PATH): anything else is Envoy's 404, so an engine's own
    endpoints (/metrics, /flush_cache, /update_weights_from_disk) stay out of clients' reach."""

    extra_paths: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ControlHeaders:
    """Peers (CIDR ranges, e.g. an operator's gateway in front of Envoy) whose control headers
    (contract.CONTROL_HEADERS) Envoy keeps; from every other client it strips them."""

    trusted_peers: tuple[str, ...] = ()


DEFAULT_MEDIA_TOKENS = 1000  # `FleetSpec.media_tokens`
MAX_MEDIA_TOKENS = 1 << 20

# `Sharing.stagger_ms` unless set: twice the bus's one-way delay within a region (about 1 ms,
# `sim.offline.PEER_LOCAL_S`).
DEFAULT_STAGGER_MS = 2.0


@dataclass(frozen=True, slots=True)
class Sharing:
    """Bookings shared between the routers of this fleet (`gorgo.core.peers`): each publishes
    what it routes and what ends on ``subject`` of the NATS server at ``nats``, and counts the
    others' as its own. Every router of the fleet names the same server and subject.

    ``stagger_ms``: a router ranked r among its live peers (by router id) decides each request
    r x this later, so that what its lower-ranked peers routed at the same moment has reached it
    (`Router.stagger_s`). Above the bus's one-way delay between routers of one region; 0: off."""

    nats: str
    subject: str
    stagger_ms: float = DEFAULT_STAGGER_MS


MAX_STAGGER_MS = 50.0  # `Sharing.stagger_ms`: beyond a region's bus delay, latency for nothing
HEADER_MODES = ("send", "skip")


@dataclass(frozen=True, slots=True)
class ExtProcMode:
    """How Envoy talks to the router. ``response_headers: send`` (the default) sends every
    response's headers back to the router, which reads the status (penalties, retries) and tags
    the response; ``skip`` saves that round trip: Envoy tags the response from the decision's
    metadata, ejects failing replicas by outlier detection, and the router reads each replica's
    errors and ejections from Envoy's admin API instead (`gorgo extproc --envoy-admin`).

    ``request_headers: send`` (the default) opens each stream with the request's headers;
    ``skip`` saves that round trip too: the body message carries what the router reads of the
    headers as ext_proc request attributes, and Envoy holds the headers until the body is
    answered, then sets the routing headers from the decision's metadata (`gorgo envoy-config`).
    Body-less GETs still send their headers: they have no body message to route on.

    ``response_trailers`` (full-duplex body mode only): ``skip`` (the default) lets Envoy close
    the router's stream at the response headers, so an answer never depends on the router once
    it streams; the booking of a streamed answer is then held for its predicted decoding time
    (the `decode` term), not its real end; ``send`` keeps the stream, and the booking, for the
    whole response, but then a router that dies, or stops past ``--drain-s``, cuts every answer
    still streaming through it (Envoy cannot fail a full-duplex stream open)."""

    response_headers: str = "send"
    request_headers: str = "send"
    response_trailers: str = "skip"

    @property
    def skip_response_headers(self) -> bool:
        return self.response_headers == "skip"

    @property
    def skip_request_headers(self) -> bool:
        return self.request_headers == "skip"


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """The fleet file's ``models.<name>``: what requests for that model route by instead of the
    fleet's ``policy``, ``objective`` and ``weights`` (None: the fleet's). A model with its own
    weights or objective is routed on fixed weights (the fleet file's ``weights``, overridden key
    by key), outside the tuner: the tuner learns the fleet's weights for the fleet's objective."""

    name: str
    policy: str | None = None
    objective: str | None = None
    weights: Weights | None = None  # set whenever the model has its own weights or objective


@dataclass(frozen=True, slots=True)
class FleetSpec:
    replicas: tuple[ReplicaSpec, ...]
    regions: tuple[RegionSpec, ...]
    proxy_region: str
    policy: str = "gorgo"
    objective: str = TTFT  # what the gorgo policy minimises (gorgo.core.terms.OBJECTIVES)
    allow_policy_override: bool = False
    weights: Weights = field(default_factory=Weights)
    block_tokens: int = 64
    chars_per_token: float = 4.0
    # Tokens one image, audio, video or file part of a prompt counts for (`gorgo.core.features`).
    # The engine's own count depends on the model and the media (LLaVA-1.5: 576 an image;
    # Qwen2.5-VL: one per 28 x 28 pixels, about 1,300 at 1024 x 1024; Gemma 3: 256), which the
    # router cannot read without decoding the media. 0: a part counts only its short mark.
    media_tokens: int = DEFAULT_MEDIA_TOKENS
    default_cluster: str = ""
    timeouts: Timeouts = field(default_factory=Timeouts)
    signals: Signals = field(default_factory=Signals)
    limits: Limits = field(default_factory=Limits)
    shedding: Shedding = field(default_factory=Shedding)
    slo: Slo = field(default_factory=Slo)
    penalties: Penalties = field(default_factory=Penalties)
    retries: Retries = field(default_factory=Retries)
    upstream: Upstream = field(default_factory=Upstream)
    observability: Observability = field(default_factory=Observability)
    routes: Routes = field(default_factory=Routes)
    control_headers: ControlHeaders = field(default_factory=ControlHeaders)
    extproc: ExtProcMode = field(default_factory=ExtProcMode)
    sharing: Sharing | None = None  # None: each router counts only its own requests
    name: str = "fleet"
    # Also answer with the Gateway API Inference Extension's endpoint-picker header/metadata.
    endpoint_picker: bool = False
    model_settings: tuple[ModelSettings, ...] = ()  # ``models:``, per model name

    def settings_for(self, model: str) -> ModelSettings | None:
        """The settings requests for ``model`` (a model or one of its aliases) route by."""
        model = next((m for r in self.replicas for a, m in r.aliases if a == model), model)
        return next((m for m in self.model_settings if m.name == model), None)

    @property
    def region_names(self) -> list[str]:
        return [r.name for r in self.regions]

    @property
    def models(self) -> tuple[str, ...]:
        """The models the fleet serves (the union, in file order); empty when no replica lists
        any, and every replica serves whatever is asked."""
        return tuple(dict.fromkeys(m for r in self.replicas for m in r.models))

    def model_asked(self, model: str | None) -> str | None:
        """The model a request is for: the one it names, else the fleet's only model (None: it
        names none, and the fleet lists several or none). The router's candidates and settings
        and irb's plan all resolve it here."""
        known = self.models
        return model if model is not None or len(known) != 1 else known[0]

    def replica(self, name: str) -> ReplicaSpec:
        for r in self.replicas:
            if r.name == name:
                return r
        raise KeyError(name)


# --- validation helpers -------------------------------------------------------------------------


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise FleetError(f"{path}: expected a mapping, got {type(value).__name__}")
    return value


def _check_keys(obj: Mapping[str, Any], allowed: set[str], path: str) -> None:
    unknown = sorted(map(str, set(obj) - allowed))
    if unknown:
        raise FleetError(
            f"{path}.{unknown[0]}: unknown field (allowed: {', '.join(sorted(allowed))})"
        )


# Above this an integer is no longer exact as a float, nor safe in the state's int64 arithmetic.
MAX_INT = 2**53


def finite_number(value: Any) -> float | None:
    """``value`` as a finite float, or None for anything else: a bool, a string, NaN, an
    infinity, or an integer beyond a float's range (on which `math.isfinite` raises
    OverflowError: a traceback wherever a config, a state file or a request body carried one)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        x = float(value)
    except OverflowError:
        return None
    return x if math.isfinite(x) else None


def _num(
    obj: Mapping[str, Any], key: str, path: str, default: float, *, minimum: float = 0.0,
    strict: bool = False, maximum: float = math.inf, cast: Callable[[Any], float] = float,
) -> Any:
    """A finite number within bounds: YAML's .nan and .inf are numbers too, and a NaN passes
    every comparison, so one would reach the router's arrays and make every cost NaN."""
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FleetError(f"{path}.{key}: expected a number, got {value!r}")
    if isinstance(value, int) and abs(value) > MAX_INT:  # else isfinite raises OverflowError
        raise FleetError(f"{path}.{key}: must be within +-2^53, got {str(value)[:40]}")
    if not math.isfinite(value):
        raise FleetError(f"{path}.{key}: expected a finite number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        op = ">" if strict else ">="
        raise FleetError(f"{path}.{key}: must be {op} {minimum}, got {value!r}")
    if cast is int:
        maximum = min(maximum, MAX_INT)
    if value > maximum:
        most = str(int(maximum)) if cast is int else f"{maximum:g}"
        raise FleetError(f"{path}.{key}: must be <= {most}, got {value!r}")
    if cast is int and value != int(value):
        raise FleetError(f"{path}.{key}: expected an integer, got {value!r}")
    return cast(value)


def _str(obj: Mapping[str, Any], key: str, path: str, default: str | None = None) -> str:
    value = obj.get(key, default)
    if value is None:
        raise FleetError(f"{path}.{key}: required")
    if not isinstance(value, str) or not value:
        raise FleetError(f"{path}.{key}: expected a non-empty string, got {value!r}")
    return value


def _bool(obj: Mapping[str, Any], key: str, path: str) -> bool:
    value = obj.get(key, False)
    if not isinstance(value, bool):
        raise FleetError(f"{path}.{key}: expected true or false, got {value!r}")
    return value


SIM_REGION_FIELDS = {"link", "rtt_ms", "jitter_ms"}


def _region(name: str, raw: Any, path: str) -> RegionSpec:
    """A region; its emulated link (simulator only) lives in its ``sim`` section."""
    raw = _mapping({} if raw is None else raw, path)
    moved = sorted(SIM_REGION_FIELDS & set(raw))
    if moved:
        raise FleetError(f"{path}.{moved[0]}: simulator-only: move it under {path}.sim")
    _check_keys(raw, {"sim"}, path)
    sraw = _mapping(raw.get("sim") or {}, f"{path}.sim")
    _check_keys(sraw, SIM_REGION_FIELDS, f"{path}.sim")
    if "link" in sraw:
        preset = sraw["link"]
        if not isinstance(preset, str) or preset not in LINK_PRESETS:
            raise FleetError(
                f"{path}.sim.link: unknown preset {preset!r} (known: {', '.join(LINK_PRESETS)})"
            )
        rtt, jitter = LINK_PRESETS[preset]
    else:
        rtt, jitter = LINK_PRESETS.get(name, LINK_PRESETS["local"])
    return RegionSpec(
        name=name,
        rtt_ms=_num(sraw, "rtt_ms", f"{path}.sim", rtt),
        jitter_ms=_num(sraw, "jitter_ms", f"{path}.sim", jitter),
    )


def _address(value: str, path: str) -> str:
    """host:port in the one form Envoy matches a retry's endpoint by (its override-host list):
    an IP as Python writes it, an IPv6 one in brackets, an ASCII port without leading zeros
    (`127.0.0.1:08000` or `[0:0::1]:P` sent a third of the retried requests elsewhere); a DNS
    name as given. Never a URL (`http://...` was probed at `http://http://...` for ever)."""
    try:
        return host_port(*split_address(value))
    except ValueError as exc:
        raise FleetError(f"{path}: {exc}") from None


def split_address(value: str, lowest_port: int = 1) -> tuple[str, int]:
    """HOST:PORT as (host, port): an IP as Python writes it (IPv6 without its brackets) or a DNS
    name as given, and a port of ``lowest_port`` to 65535. The one check of every HOST:PORT, in
    a fleet file or on a command line; a ValueError that says what is wrong otherwise."""
    host, sep, port_text = value.rpartition(":")
    port = whole_number(port_text, 10)  # leading zeros are read (08000 is 8000)
    if not (sep and host and port is not None and lowest_port <= port <= MAX_PORT) \
            or "/" in value or any(c.isspace() for c in value):
        raise ValueError(f"expected host:port (an IPv6 host in brackets, no URL) with a port of "
                         f"{lowest_port} to {MAX_PORT}, got {value!r}")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        if bracketed or ":" in host or not _DNS_NAME.fullmatch(host):
            raise ValueError(f"{host!r} is neither an IP address (IPv6 in brackets) "
                             "nor a DNS name") from None
        return host, port
    if ip.version == 6 and not bracketed:
        raise ValueError(f"an IPv6 address is written in brackets, "
                         f"{host_port(str(ip), port)}, got {value!r}")
    return str(ip), port


def _label(obj: Mapping[str, Any], key: str, path: str, default: str | None = None) -> str:
    """A name that travels in headers, Envoy's cluster names and log lines: no control
    character or surrounding space (YAML's `name: |` keeps a newline, and every request to such
    a replica failed with an empty 500)."""
    value = _str(obj, key, path, default)
    if value != value.strip() or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise FleetError(f"{path}.{key}: no control characters or surrounding spaces, "
                         f"got {value!r}")
    return value


def _url(obj: Mapping[str, Any], key: str, path: str, default: str) -> str:
    """An http(s) URL with a host and a valid port (a URL without its scheme, or a port of
    99999, left the replica ejected for good, with no reason logged)."""
    value = _str(obj, key, path, default)
    if not http_url(value):
        raise FleetError(f"{path}.{key}: expected an http(s) URL like http://host:port/path, "
                         f"got {value!r}")
    return value


def _replica(raw: Any, path: str, regions: set[str]) -> ReplicaSpec:
    raw = _mapping(raw, path)
    _check_keys(
        raw,
        {"name", "region", "cluster", "address", "engine", "health_url", "metrics_url",
         "prefill_rate", "kv_capacity_tokens", "sim", "cache", "models", "drain", "params",
         *PRECISE_FIELDS},
        path,
    )
    name = _label(raw, "name", path)
    region = _str(raw, "region", path)
    if region not in regions:
        raise FleetError(f"{path}.region: unknown region {region!r} (known: {sorted(regions)})")
    engine = _str(raw, "engine", path)
    if engine not in ENGINE_KINDS:
        raise FleetError(f"{path}.engine: must be one of {ENGINE_KINDS}, got {engine!r}")
    address = _address(_str(raw, "address", path), f"{path}.address")
    sim = None
    if engine == "sim":
        sraw = _mapping(raw.get("sim") or {}, f"{path}.sim")
        _check_keys(sraw, {"profile", "flavor", "port", "speed", "kv_tokens"}, f"{path}.sim")
        flavor = _str(sraw, "flavor", f"{path}.sim", "sglang")
        if flavor not in ("sglang", "vllm"):
            raise FleetError(f"{path}.sim.flavor: must be sglang or vllm, got {flavor!r}")
        sim = SimEngineSpec(
            profile=_str(sraw, "profile", f"{path}.sim", DEFAULT_PROFILE),
            flavor=flavor,
            port=_num(sraw, "port", f"{path}.sim", 0, cast=int),
            speed=_num(sraw, "speed", f"{path}.sim", 1.0, strict=True),
            kv_tokens=_num(sraw, "kv_tokens", f"{path}.sim", 0, cast=int),
        )
    elif "sim" in raw:
        raise FleetError(f"{path}.sim: only allowed with engine: sim")
    precise = _precise(raw, path, engine, sim)
    return ReplicaSpec(
        name=name,
        region=region,
        cluster=_cluster_name(raw, path, name),
        address=address,
        engine=engine,
        health_url=_url(raw, "health_url", path, f"http://{address}/health"),
        metrics_url=_url(raw, "metrics_url", path, f"http://{address}/metrics"),
        prefill_rate=_num(raw, "prefill_rate", path, 10000.0, strict=True),
        kv_capacity_tokens=_num(raw, "kv_capacity_tokens", path, 500_000, minimum=1, cast=int),
        sim=sim,
        cache=PRECISE if precise else APPROXIMATE,
        precise=precise,
        drain=_bool(raw, "drain", path),
        params=_term_params(raw, path),
        **_models(raw, path),
    )


def http_url(value: str) -> bool:
    """Whether ``value`` is an http(s) URL with a host and a valid port, without spaces (the
    tuner took http://127.0.0.1:99999 and http:// as routers and retried them for ever)."""
    try:
        parts = urlsplit(value)
    except ValueError:  # an unclosed IPv6 bracket
        return False
    return (parts.scheme in ("http", "https") and bool(parts.hostname) and _port_ok(parts)
            and not any(c.isspace() for c in value))


def _port_ok(parts: SplitResult) -> bool:
    """Whether a URL's port, if it names one, is a number of 1 to 65535 (0 connects nowhere)."""
    try:
        return parts.port != 0
    except ValueError:
        return False


def _cluster_name(raw: Mapping[str, Any], path: str, name: str) -> str:
    cluster = _label(raw, "cluster", path, name)
    if cluster in RESERVED_CLUSTERS:
        raise FleetError(f"{path}.cluster: {cluster!r} is a cluster of GORGO's own Envoy config "
                         f"(reserved: {', '.join(sorted(RESERVED_CLUSTERS))}); name the replica "
                         "or its cluster otherwise")
    return cluster


def _term_params(raw: Mapping[str, Any], path: str) -> tuple[tuple[str, str, float], ...]:
    """A replica's ``params:``: ``{term: {param: value > 0}}`` over the registry's term params."""
    path = f"{path}.params"
    out = []
    for term, values in _mapping(raw.get("params") or {}, path).items():
        known = BY_NAME.get(term)
        if known is None or not known.params:
            with_params = sorted(n for n, t in BY_NAME.items() if t.params)
            raise FleetError(f"{path}: {term!r} is not a term with parameters "
                             f"(known: {with_params})")
        values = _mapping(values, f"{path}.{term}")
        _check_keys(values, set(known.params), f"{path}.{term}")
        out += [(term, key, _num(values, key, f"{path}.{term}", 0.0, strict=True))
                for key in values]
    return tuple(out)


def _models(raw: Mapping[str, Any], path: str) -> dict[str, tuple]:
    """A replica's ``models:``: each a name, or ``{name, aliases: [...]}``."""
    models: list[str] = []
    aliases: list[tuple[str, str]] = []
    for i, entry in enumerate(_list(raw, "models", path)):
        where = f"{path}.models[{i}]"
        if isinstance(entry, str):
            entry = {"name": entry}
        entry = _mapping(entry, where)
        _check_keys(entry, {"name", "aliases"}, where)
        name = _str(entry, "name", where)
        for j, alias in enumerate(_list(entry, "aliases", where)):
            if not isinstance(alias, str) or not alias:
                raise FleetError(f"{where}.aliases[{j}]: expected a non-empty string, "
                                 f"got {alias!r}")
            aliases.append((alias, name))
        models.append(name)
    names = [*models, *(a for a, _ in aliases)]
    for name in names:
        if names.count(name) > 1:
            raise FleetError(f"{path}.models: {name!r} is listed twice")
    return {"models": tuple(models), "aliases": tuple(aliases)}


def _check_models(replicas: tuple[ReplicaSpec, ...], source: str) -> None:
    """Either every replica lists its models or none does (then each serves whatever is asked),
    and a name means one model fleet-wide: an alias is never another replica's model."""
    listed = [bool(r.models) for r in replicas]
    if any(listed) and not all(listed):
        i = listed.index(False)
        raise FleetError(f"{source}.replicas[{i}].models: required once any replica lists its "
                         "models (a replica without them would be asked for every model)")
    meaning: dict[str, str] = {m: m for r in replicas for m in r.models}
    for i, r in enumerate(replicas):
        for alias, model in r.aliases:
            if meaning.setdefault(alias, model) != model:
                raise FleetError(f"{source}.replicas[{i}].models: alias {alias!r} of {model!r} "
                                 f"already names {meaning[alias]!r}")


PRECISE_FIELDS = ("tokenizer", "hash_seed", "kv_events")
_ZMQ_ENDPOINT = re.compile(r"(tcp://[^\s/]+:\d+|ipc://\S+)")


def _precise(raw: Mapping[str, Any], path: str, engine: str,
             sim: SimEngineSpec | None) -> PreciseSpec | None:
    """The replica's cache view: approximate (the default), or precise from its KV events, which
    only vLLM (or the simulator in vLLM's flavor) publishes."""
    cache = _str(raw, "cache", path, APPROXIMATE)
    if cache not in CACHE_MODES:
        raise FleetError(f"{path}.cache: must be one of {', '.join(CACHE_MODES)}, got {cache!r}")
    if cache == APPROXIMATE:
        extra = [k for k in PRECISE_FIELDS if k in raw]
        if extra:
            raise FleetError(f"{path}.{extra[0]}: only allowed with cache: precise")
        return None
    if engine == "sglang" or (sim is not None and sim.flavor != "vllm"):
        raise FleetError(f"{path}.cache: precise needs vLLM's KV events: engine: vllm, or "
                         "engine: sim with sim.flavor: vllm")
    seed = raw.get("hash_seed", DEFAULT_SEED)
    if not isinstance(seed, str):
        raise FleetError(f"{path}.hash_seed: expected a string (the engine's PYTHONHASHSEED), "
                         f"got {seed!r}")
    events = None
    if raw.get("kv_events") is not None:
        epath = f"{path}.kv_events"
        eraw = _mapping(raw["kv_events"], epath)
        _check_keys(eraw, set(KVEventsSpec.__dataclass_fields__), epath)
        endpoints = {}
        for key in ("endpoint", "replay_endpoint"):
            value = eraw.get(key)
            if value is None and key == "replay_endpoint":
                continue
            if not isinstance(value, str) or not _ZMQ_ENDPOINT.fullmatch(value):
                raise FleetError(f"{epath}.{key}: expected a ZMQ endpoint like "
                                 f"tcp://127.0.0.1:5557 or ipc:///path, got {value!r}")
            endpoints[key] = value
        topic = eraw.get("topic", "")
        if not isinstance(topic, str):
            raise FleetError(f"{epath}.topic: expected a string, got {topic!r}")
        events = KVEventsSpec(endpoints["endpoint"], endpoints.get("replay_endpoint"), topic)
    return PreciseSpec(_str(raw, "tokenizer", path), seed, events)


def _section(raw: Mapping[str, Any], key: str, cls: type, path: str) -> Any:
    sraw = _mapping(raw.get(key) or {}, f"{path}.{key}")
    defaults = cls()
    names = set(cls.__dataclass_fields__)
    _check_keys(sraw, names, f"{path}.{key}")
    values = {}
    for name in names:
        default = getattr(defaults, name)
        cast = int if isinstance(default, int) else float
        bounds = cls.__dataclass_fields__[name].metadata
        values[name] = _num(sraw, name, f"{path}.{key}", default, cast=cast, **bounds)
    return cls(**values)


# A DNS name (a Service, a host): letters, digits, '-', '_' and '.'.
_DNS_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})")
# gRPC takes a message of at most 2^31 - 1 bytes, and the router's is the body plus 64 KiB.
MAX_BODY_BYTES = 2**31 - 1 - 65536
# Python's JSON decoder recurses per level and stops at the interpreter's recursion limit (1000
# frames, less the caller's); a depth limit well inside it is the one a client ever meets.
MAX_JSON_DEPTH = 256


def _limits(raw: Mapping[str, Any], path: str) -> Limits:
    """Every limit is at least 1 (0 would refuse every request)."""
    limits = _section(raw, "limits", Limits, path)
    for name in Limits.__dataclass_fields__:
        if getattr(limits, name) < 1:
            raise FleetError(f"{path}.limits.{name}: must be >= 1, got {getattr(limits, name)!r}")
    if limits.max_body_bytes > MAX_BODY_BYTES:  # gRPC's message limit is an int32
        raise FleetError(f"{path}.limits.max_body_bytes: must be <= {MAX_BODY_BYTES}, "
                         f"got {limits.max_body_bytes!r}")
    if limits.max_json_depth > MAX_JSON_DEPTH:
        raise FleetError(f"{path}.limits.max_json_depth: must be <= {MAX_JSON_DEPTH}, "
                         f"got {limits.max_json_depth!r}")
    return limits


def unbracketed(host: str) -> str:
    """A host as a socket address takes it: an IPv6 address without its URL brackets."""
    return host.removeprefix("[").removesuffix("]")


def host_port(host: str, port: int) -> str:
    """host:port as URLs and gRPC read it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def ip_literal(host: str) -> bool:
    """True for an IPv4 or (bracketed) IPv6 address, False for a DNS name."""
    try:
        ipaddress.ip_address(unbracketed(host))
    except ValueError:
        return False
    return True


def _retries(raw: Mapping[str, Any], replicas: tuple[ReplicaSpec, ...], path: str) -> Retries:
    """Retries name the next-best replica by IP:port (Envoy's override-host policy matches
    endpoints by address), so they default to on only when every replica address is an IP."""
    rraw = _mapping(raw.get("retries") or {}, path)
    _check_keys(rraw, set(Retries.__dataclass_fields__), path)
    named = [r.address for r in replicas if not ip_literal(r.host)]
    enabled = rraw.get("enabled", not named)
    if not isinstance(enabled, bool):
        raise FleetError(f"{path}.enabled: expected true or false, got {enabled!r}")
    if enabled and named:
        raise FleetError(
            f"{path}.enabled: retries need IP:port replica addresses, got {named[0]!r}")
    percent = _num(rraw, "budget_percent", path, 20.0, strict=True)
    if percent > 100:
        raise FleetError(f"{path}.budget_percent: must be <= 100, got {percent!r}")
    return Retries(
        enabled=enabled,
        budget_percent=percent,
        min_retry_concurrency=_num(rraw, "min_retry_concurrency", path, 3, cast=int,
                                   maximum=2**32 - 1),  # Envoy's UInt32Value
    )


# An exact URL path of unreserved characters: no query, no percent-encoding, no dot segments, so
# the path Envoy matches is the path the engine serves.
_PATH = re.compile(r"(/[A-Za-z0-9._~-]+)+")


def _list(raw: Mapping[str, Any], key: str, path: str) -> list[Any]:
    value = raw.get(key) or []
    if not isinstance(value, list):
        raise FleetError(f"{path}.{key}: expected a list, got {value!r}")
    return value


def _routes(raw: Mapping[str, Any], path: str) -> Routes:
    rraw = _mapping(raw.get("routes") or {}, path)
    _check_keys(rraw, set(Routes.__dataclass_fields__), path)
    seen = {*API_PATHS, HEALTH_PATH}
    paths = []
    for i, p in enumerate(_list(rraw, "extra_paths", path)):
        where = f"{path}.extra_paths[{i}]"
        if not isinstance(p, str) or not _PATH.fullmatch(p) or {".", ".."} & set(p.split("/")):
            raise FleetError(f"{where}: expected an exact path like /v1/embeddings, got {p!r}")
        if p in seen:
            raise FleetError(f"{where}: {p!r} is already forwarded")
        seen.add(p)
        paths.append(p)
    return Routes(extra_paths=tuple(paths))


def _control_headers(raw: Mapping[str, Any], path: str) -> ControlHeaders:
    craw = _mapping(raw.get("control_headers") or {}, path)
    _check_keys(craw, set(ControlHeaders.__dataclass_fields__), path)
    peers = []
    for i, cidr in enumerate(_list(craw, "trusted_peers", path)):
        try:
            peers.append(str(ipaddress.ip_network(cidr if isinstance(cidr, str) else "")))
        except ValueError:
            raise FleetError(f"{path}.trusted_peers[{i}]: expected a CIDR range like "
                             f"10.0.0.0/8 (host bits zero), got {cidr!r}") from None
    # one each: a range named twice (192.0.2.7 and 192.0.2.7/32) made Envoy refuse the listener
    return ControlHeaders(trusted_peers=tuple(dict.fromkeys(peers)))


def _observability(raw: Mapping[str, Any], path: str) -> Observability:
    oraw = _mapping(raw.get("observability") or {}, path)
    _check_keys(oraw, set(Observability.__dataclass_fields__), path)
    interval = _num(oraw, "ttft_log_interval_s", path, Observability().ttft_log_interval_s,
                    maximum=ENVOY_MAX_S)
    if 0 < interval < ENVOY_LEAST_FLUSH_S:  # Envoy refused the rendered config, not the fleet
        raise FleetError(f"{path}.ttft_log_interval_s: must be 0 (off) or >= "
                         f"{ENVOY_LEAST_FLUSH_S:g} (Envoy's least flush interval), "
                         f"got {interval!r}")
    return Observability(access_log=_bool(oraw, "access_log", path),
                         access_log_path=_str(oraw, "access_log_path", path, "/dev/stdout"),
                         ttft_log_interval_s=interval)


def _sharing(raw: Mapping[str, Any], path: str, fleet: str) -> Sharing | None:
    if raw.get("sharing") is None:
        return None
    sraw = _mapping(raw["sharing"], path)
    _check_keys(sraw, {"nats", "subject", "stagger_ms"}, path)
    url = _str(sraw, "nats", path, "")
    parts = urlsplit(url)
    if parts.scheme not in ("nats", "tls") or not parts.hostname or not _port_ok(parts):
        raise FleetError(f"{path}.nats: expected a NATS server URL like nats://host:4222, "
                         f"got {url!r}")
    subject = _str(sraw, "subject", path, f"gorgo.bookings.{fleet}")
    if not subject or any(c in subject for c in " *>\t") or "" in subject.split("."):
        raise FleetError(f"{path}.subject: expected a NATS subject of dot-separated tokens "
                         f"without wildcards, got {subject!r}")
    stagger = _num(sraw, "stagger_ms", path, DEFAULT_STAGGER_MS)
    if stagger > MAX_STAGGER_MS:
        raise FleetError(f"{path}.stagger_ms: at most {MAX_STAGGER_MS:g} ms (each router ranked "
                         f"r waits r x this for every request), got {stagger!r}")
    return Sharing(nats=url, subject=subject, stagger_ms=stagger)


DEFAULT_EXTPROC = ExtProcMode()


def _extproc(raw: Mapping[str, Any], path: str) -> ExtProcMode:
    eraw = _mapping(raw.get("extproc") or {}, path)
    _check_keys(eraw, set(ExtProcMode.__dataclass_fields__), path)
    modes = {}
    for key in ExtProcMode.__dataclass_fields__:
        modes[key] = _str(eraw, key, path, getattr(DEFAULT_EXTPROC, key))
        if modes[key] not in HEADER_MODES:
            raise FleetError(f"{path}.{key}: must be one of {', '.join(HEADER_MODES)}, "
                             f"got {modes[key]!r}")
    return ExtProcMode(**modes)


def _policy(raw: Mapping[str, Any], source: str, default: str = "gorgo") -> str:
    # Imported here: the policies import this module for FleetSpec.
    from gorgo.core.policies import REGISTRY

    policy = _str(raw, "policy", source, default)
    if policy not in REGISTRY:
        raise FleetError(
            f"{source}.policy: unknown policy {policy!r} (known: {', '.join(REGISTRY)})")
    return policy


def _objective(raw: Mapping[str, Any], path: str, default: str = TTFT) -> str:
    objective = _str(raw, "objective", path, default)
    if objective not in OBJECTIVES:
        raise FleetError(f"{path}.objective: must be one of {', '.join(OBJECTIVES)}, "
                         f"got {objective!r}")
    return objective


def _weights(raw: Mapping[str, Any], path: str, base: Weights | None = None) -> Weights:
    """The cost weights, one per weighted term of the registry, inside the contract's bounds; a
    key not given is ``base``'s (default: the term's default)."""
    base = base or Weights()
    wraw = _mapping(raw.get("weights") or {}, path)
    _check_keys(wraw, set(WEIGHT_BOUNDS), path)
    values = {}
    for key, (lo, hi) in WEIGHT_BOUNDS.items():
        values[key] = _num(wraw, key, path, base[key], minimum=lo, maximum=hi)
    return Weights(values)


MODEL_SETTINGS = ("objective", "policy", "weights")


def _model_settings(raw: Mapping[str, Any], replicas: tuple[ReplicaSpec, ...], weights: Weights,
                    source: str) -> tuple[ModelSettings, ...]:
    """``models:``: a mapping of model name to its own ``policy``, ``objective`` and ``weights``."""
    path = f"{source}.models"
    doc = _mapping(raw.get("models") or {}, path)
    served = list(dict.fromkeys(m for r in replicas for m in r.models))
    aliases = {a: m for r in replicas for a, m in r.aliases}
    out = []
    for name, entry in doc.items():
        where = f"{path}.{name}"
        if name in aliases:
            raise FleetError(f"{where}: an alias of {aliases[name]!r}: set its settings there")
        if name not in served:
            known = ", ".join(served) or "none: list each replica's models"
            raise FleetError(f"{where}: no replica serves this model (served: {known})")
        entry = _mapping(entry, where)
        _check_keys(entry, set(MODEL_SETTINGS), where)
        if not entry:
            raise FleetError(f"{where}: set at least one of {', '.join(MODEL_SETTINGS)}")
        own = "weights" in entry or "objective" in entry
        out.append(ModelSettings(
            name=str(name),
            policy=_policy(entry, where) if "policy" in entry else None,
            objective=_objective(entry, where) if "objective" in entry else None,
            weights=_weights(entry, f"{where}.weights", weights) if own else None,
        ))
    return tuple(out)


def parse_fleet(raw: Any, source: str = "fleet") -> FleetSpec:
    """Validate a decoded fleet document; every error names the field it is about."""
    raw = _mapping(raw, source)
    _check_keys(
        raw,
        {"name", "proxy_region", "regions", "replicas", "policy", "objective",
         "allow_policy_override", "models",
         "weights", "block_tokens", "chars_per_token", "media_tokens", "default_cluster",
         "timeouts", "signals",
         "limits", "endpoint_picker", "shedding", "slo", "penalties", "retries", "upstream",
         "routes", "control_headers", "observability", "extproc", "sharing"},
        source,
    )
    regions_raw = _mapping(raw.get("regions"), f"{source}.regions")
    if not regions_raw:
        raise FleetError(f"{source}.regions: at least one region is required")
    regions = tuple(_region(str(k), v, f"{source}.regions.{k}") for k, v in regions_raw.items())
    region_names = {r.name for r in regions}
    replicas_raw = raw.get("replicas")
    if not isinstance(replicas_raw, list) or not replicas_raw:
        raise FleetError(f"{source}.replicas: expected a non-empty list of replicas")
    replicas = tuple(
        _replica(r, f"{source}.replicas[{i}]", region_names) for i, r in enumerate(replicas_raw)
    )
    for attr in ("name", "cluster", "address"):
        seen: set[str] = set()
        for i, r in enumerate(replicas):
            value = getattr(r, attr)
            if value in seen:
                raise FleetError(f"{source}.replicas[{i}].{attr}: duplicate {value!r}")
            seen.add(value)
    _check_models(replicas, source)
    proxy_region = _str(raw, "proxy_region", source, regions[0].name)
    if proxy_region not in region_names:
        raise FleetError(f"{source}.proxy_region: unknown region {proxy_region!r}")
    policy = _policy(raw, source)
    objective = _objective(raw, source)
    weights = _weights(raw, f"{source}.weights")
    allow = _bool(raw, "allow_policy_override", source)
    picker = _bool(raw, "endpoint_picker", source)
    clusters = [r.cluster for r in replicas]
    default_cluster = _str(raw, "default_cluster", source, clusters[0])
    if default_cluster not in clusters:
        raise FleetError(f"{source}.default_cluster: {default_cluster!r} is not a replica cluster")
    return FleetSpec(
        name=_str(raw, "name", source, "fleet"),
        replicas=replicas,
        regions=regions,
        proxy_region=proxy_region,
        policy=policy,
        objective=objective,
        allow_policy_override=allow,
        endpoint_picker=picker,
        weights=weights,
        block_tokens=_num(raw, "block_tokens", source, 64, minimum=1, cast=int),
        chars_per_token=_num(raw, "chars_per_token", source, 4.0, strict=True),
        media_tokens=_num(raw, "media_tokens", source, DEFAULT_MEDIA_TOKENS,
                          maximum=MAX_MEDIA_TOKENS, cast=int),
        default_cluster=default_cluster,
        timeouts=_section(raw, "timeouts", Timeouts, source),
        signals=_section(raw, "signals", Signals, source),
        limits=_limits(raw, source),
        shedding=_section(raw, "shedding", Shedding, source),
        slo=_section(raw, "slo", Slo, source),
        penalties=_section(raw, "penalties", Penalties, source),
        retries=_retries(raw, replicas, f"{source}.retries"),
        upstream=_section(raw, "upstream", Upstream, source),
        observability=_observability(raw, f"{source}.observability"),
        routes=_routes(raw, f"{source}.routes"),
        control_headers=_control_headers(raw, f"{source}.control_headers"),
        extproc=_extproc(raw, f"{source}.extproc"),
        sharing=_sharing(raw, f"{source}.sharing", _str(raw, "name", source, "fleet")),
        model_settings=_model_settings(raw, replicas, weights, source),
    )


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (the last one silently
    won: two `limits:` blocks kept only the second)."""

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # Checked once per mapping, before merges (`<<: *anchor`) flatten it in place: a merged
        # key may repeat an explicit one, which overrides it (YAML's rule).
        checked = self.__dict__.setdefault("_checked", set())
        if id(node) not in checked:
            checked.add(id(node))
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: the base class says so
                    break
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        super().flatten_mapping(node)


def parse_yaml(text: str) -> Any:
    """A fleet document's YAML (a file's, or one the admin API was sent): ValueError, on one
    line, for what is not valid YAML, repeats a key, or nests past the parser's depth."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        raise ValueError("not valid YAML: " + " ".join(str(exc).split())) from None
    except RecursionError:
        raise ValueError("not valid YAML: nested too deep") from None


def read_fleet(path: str | Path) -> Any:
    """The decoded YAML document of a fleet file (not yet validated)."""
    path = Path(path)
    try:
        return parse_yaml(path.read_text())
    except OSError as exc:
        raise FleetError(f"{path}: cannot read fleet file: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise FleetError(f"{path}: not UTF-8 text") from None
    except ValueError as exc:
        raise FleetError(f"{path}: {exc}") from None


def load_fleet(path: str | Path) -> FleetSpec:
    """Read and validate a fleet YAML file; a ``discover:`` entry stands unresolved, as the one
    replica at its DNS name (gorgo.core.discovery; the router resolves it)."""
    from gorgo.core.discovery import parse_discovered  # it builds on this module

    return parse_discovered(read_fleet(path), None, source=Path(path).name)
