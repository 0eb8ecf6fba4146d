"""Configuration: a TOML file, overridden by ``MODELWARDEN_*`` environment variables.

``modelwarden serve --config PATH`` (or ``MODELWARDEN_CONFIG``) names the file. Environment
variables override keys with ``__`` between levels; a model is addressed by its name or its
index: ``MODELWARDEN_DAEMON__LOG_LEVEL=DEBUG``, ``MODELWARDEN_MODELS__mlp__WORKERS=4``. Values are
parsed as JSON when they parse (numbers, booleans, lists), else taken as strings.

Relative paths in the file (model files, probe files, ``python_path``) are relative to the file's
directory. An invalid configuration raises ConfigError naming the key path and the problem.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from modelwarden.shared.cpulist import format_cores
from modelwarden.shared.protocol import DTYPES, ELEMENT_TYPES
from modelwarden.shared.rawconfig import (  # noqa: F401  (the names config's users import)
    ENV_CLIENT_KEY, ENV_CONFIG, ENV_ENDPOINT, ENV_PREFIX, ENV_SERVER_KEY, SYSTEM_RUNTIME_DIR,
    ConfigError, admin_endpoint, client_runtime_dir, config_path, control_endpoint,
    default_frontends, default_runtime_dir, raw_settings, read_toml, runtime_dir)

SOURCE_SCHEMES = ("torchscript", "export", "python", "handler")
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
               "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}


def parse_size(value: Any) -> int | None:
    """Bytes from an int or a string such as "2GiB", "512MB", "64KiB"."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ValueError(f"not a size: {value!r} (use bytes, or e.g. '512MiB', '2GB')")
    unit = (match.group(2) or "").upper().rstrip("B")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputSpec(_Strict):
    """One declared model input. ``-1`` in ``shape`` is a dynamic dimension (1 in warm-up).
    ``dtype`` is a tensor dtype, or "str" / "bytes" for variable-length elements (the model
    gets lists of them)."""

    name: str = Field(min_length=1, max_length=128)
    dtype: str
    shape: list[int]

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in DTYPES and value not in ELEMENT_TYPES:
            raise ValueError(f"unknown dtype {value!r}; known: "
                             f"{', '.join((*DTYPES, *ELEMENT_TYPES))}")
        return value

    @field_validator("shape")
    @classmethod
    def _dims(cls, value: list[int]) -> list[int]:
        if any(dim < -1 for dim in value):
            raise ValueError("dimensions are >= 0, or -1 for a dynamic dimension")
        return value


class ProbeConfig(_Strict):
    """The sentinel: a known input whose output is known, sent to every READY worker."""

    interval: float = Field(default=10.0, ge=0, description="seconds between probes; 0 = off")
    seed: int = 0
    input: Path | None = None
    golden: Path | None = None
    atol: float = Field(default=1e-5, ge=0)
    rtol: float = Field(default=1e-4, ge=0)
    range: tuple[float, float] | None = None
    latency_factor: float = Field(default=10.0, gt=1)
    latency_slack_ms: float = Field(default=100.0, ge=0)
    failures: int = Field(default=3, ge=1)
    timeout: float = Field(default=10.0, gt=0)
    max_replacements: int = Field(default=3, ge=0, description=(
        "replacements for failed probes in a row before the slot goes FATAL"))


class BatchingConfig(_Strict):
    """Dynamic batching in the supervisor's dispatch (see docs/ARCHITECTURE.md "Batching")."""

    max_size: int = Field(default=1, ge=1, le=256,
                          description="requests merged into one forward pass at most (1 = off)")
    max_delay_us: int = Field(default=0, ge=0, le=10_000_000,
                              description="how long a partial batch may wait for more, under load")
    dim: int = Field(default=0, ge=0, le=31, description="the batch dimension of inputs and outputs")
    max_rows: int = Field(default=0, ge=0, description="cap on the summed batch dimension (0 = none)")
    # Length buckets (docs/ARCHITECTURE.md "Length buckets"): requests whose varying length falls
    # in one bucket share a batch, padded in the worker to the batch's longest member.
    buckets: list[int] = Field(default_factory=list, max_length=64, description=(
        "edges of the varying length, increasing; [] = no buckets"))
    length_dim: int = Field(default=1, ge=0, le=31, description=(
        "the varying dimension of the (preprocessed) tensors named in 'pad'"))
    pad: dict[str, float] = Field(default_factory=dict, max_length=64, description=(
        "the tensors padded along length_dim, by input name, and their pad values"))
    mask: str | None = Field(default=None, min_length=1, max_length=128, description=(
        "an attention mask input: padded with 0, or built (1 real, 0 pad) when absent"))
    keep_length: list[str] = Field(default_factory=list, max_length=64, description=(
        "outputs that keep the varying dimension: each member gets only its own length back"))
    too_long: Literal["truncate", "refuse"] = "refuse"
    bytes_per_token: float = Field(default=4.0, gt=0, le=1024, description=(
        "text inputs: the supervisor keys a request by its longest element's bytes / this"))

    @property
    def enabled(self) -> bool:
        return self.max_size > 1

    @property
    def bucketed(self) -> bool:
        return bool(self.buckets)

    @model_validator(mode="after")
    def _buckets(self) -> "BatchingConfig":
        if any(edge < 1 for edge in self.buckets) or self.buckets != sorted(set(self.buckets)):
            raise ValueError(f"buckets {self.buckets} must be positive and strictly increasing")
        if self.buckets and not self.pad:
            raise ValueError("buckets need 'pad': the inputs padded along length_dim")
        if self.buckets and self.length_dim == self.dim:
            raise ValueError(f"length_dim {self.length_dim} is the batch dimension")
        if self.mask is not None and self.mask not in self.pad:
            raise ValueError(f"mask {self.mask!r} must be one of the padded inputs in 'pad'")
        return self


PREPARE_DTYPES = ("float32", "bfloat16", "float16")


class PrepareConfig(_Strict):
    """``[models.prepare]``: steps applied to the loaded model before warm-up (worker/prepare.py).

    A prepared model is held to its FP32 answers before it may go READY: the probe input is run
    through the model as loaded, then through the prepared one, and every output must satisfy
    ``|prepared - fp32| <= atol + rtol * |fp32|``. The defaults fit bfloat16."""

    freeze: bool = Field(default=False, description=(
        "TorchScript only: torch.jit.freeze, then torch.jit.optimize_for_inference"))
    compile: bool | str = Field(default=False, description=(
        "torch.compile; true = mode \"default\", or a mode such as \"reduce-overhead\""))
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description=(
        "weights and floating inputs cast to it; floating outputs come back as float32"))
    atol: float = Field(default=1e-2, ge=0)
    rtol: float = Field(default=1e-2, ge=0)

    @field_validator("compile")
    @classmethod
    def _mode(cls, value: bool | str) -> bool | str:
        if isinstance(value, str) and not re.match(r"^[a-z][a-z-]{0,63}$", value):
            raise ValueError(f"compile = {value!r}: true, false or a torch.compile mode "
                             "(\"default\", \"reduce-overhead\", \"max-autotune-no-cudagraphs\"...)")
        return value

    @property
    def compile_mode(self) -> str | None:
        if self.compile is False:
            return None
        return "default" if self.compile is True else self.compile

    @property
    def steps(self) -> list[str]:
        """The steps in the order they are applied: a cast first (frozen constants keep it),
        freeze next, compile last (it traces what the others made)."""
        steps = [f"dtype={self.dtype}"] if self.dtype != "float32" else []
        if self.freeze:
            steps.append("freeze")
        if self.compile_mode is not None:
            steps.append(f"compile(mode={self.compile_mode})")
        return steps


class ModelConfig(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    source: str
    kwargs: dict[str, Any] = Field(default_factory=dict)
    version: str | None = Field(default=None, min_length=1, max_length=128, description=(
        "default: a hash of the model file or factory module and the kwargs"))
    workers: int = Field(default=1, ge=1, le=1024)
    standby: int = Field(default=0, ge=0, le=64, description=(
        "warm standby workers, promoted into a slot whose worker dies or is retired"))
    device: str | list[str] = "cpu"
    cores_per_worker: int | None = Field(default=None, ge=1)
    cores: list[list[int]] | None = None
    threads: int | None = Field(default=None, ge=1)
    warmup: int = Field(default=20, ge=0)
    inputs: list[InputSpec] | None = None
    # Names, dtypes and shapes of the outputs, in the order the model returns them: what the
    # KServe v2 gateway reports and names its outputs by (default output__0, output__1...).
    outputs: list[InputSpec] | None = None
    reject_nonfinite: bool = False
    cuda_fallback_to_cpu: bool = False
    # weights from a file (worker/weights.py): "mmap" shares one copy between workers
    weights: Literal["load", "mmap"] = "load"
    weights_file: str | None = Field(default=None, min_length=1, description=(
        ".safetensors, .pt or .pth state dict; relative to the file, or package:NAME/PATH"))
    # requests
    timeout: float = Field(default=30.0, gt=0, description="default request deadline, seconds")
    max_queue: int = Field(default=1024, ge=1)
    # Left out: 2 without batching, so a worker finds its next request waiting when it finishes
    # one instead of idling for the supervisor's hop (docs/BENCHMARKS.md, the ceiling); 1 with
    # batching, where a request that waits in the queue while every worker is busy can still
    # join a batch, and one sent to a busy worker cannot.
    max_inflight: int | None = Field(default=None, ge=1, le=64, description=(
        "requests sent to one worker at a time; default 2, or 1 with batching on"))
    retries: int = Field(default=1, ge=0, le=1)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    # health and restarts
    heartbeat_timeout: float = Field(default=30.0, gt=0)
    start_timeout: float = Field(default=300.0, gt=0)
    start_seconds: float = Field(default=10.0, ge=0)
    max_start_failures: int = Field(default=5, ge=1)
    ready_min: int | None = Field(default=None, ge=0, description=(
        "READY workers the daemon waits for before telling systemd READY=1 (default: all)"))
    backoff_initial: float = Field(default=0.5, ge=0)
    backoff_max: float = Field(default=30.0, ge=0)
    kill_grace: float = Field(default=5.0, ge=0)
    drain_timeout: float = Field(default=30.0, ge=0)
    fatal_retry: float = Field(default=300.0, ge=0, description="a FATAL slot tries again after "
                               "this many seconds; 0 = never")
    # recycling
    max_rss: int | None = None
    max_cuda_memory: int | None = None
    max_requests: int | None = Field(default=None, ge=1)
    max_requests_jitter: int = Field(default=0, ge=0)
    probe: ProbeConfig = Field(default_factory=ProbeConfig)
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)

    @field_validator("max_rss", "max_cuda_memory", mode="before")
    @classmethod
    def _sizes(cls, value: Any) -> int | None:
        return parse_size(value)

    @field_validator("source")
    @classmethod
    def _scheme(cls, value: str) -> str:
        scheme, sep, rest = value.partition(":")
        if not sep or scheme not in SOURCE_SCHEMES or not rest:
            raise ValueError(f"unknown source scheme in {value!r}; use torchscript:PATH, "
                             "export:PATH, python:module:callable or handler:module:Class")
        if scheme in ("python", "handler") and not re.match(r"^[\w.]+:[\w.]+$", rest):
            what = "callable" if scheme == "python" else "Class"
            raise ValueError(f"{scheme} source must be {scheme}:module:{what}, got {value!r}")
        return value

    @field_validator("device")
    @classmethod
    def _devices(cls, value: str | list[str]) -> str | list[str]:
        for device in [value] if isinstance(value, str) else value:
            if not re.match(r"^(cpu|cuda|cuda:[0-9]+)$", device):
                raise ValueError(f"device {device!r}: use cpu, cuda, cuda:N, or a list of them")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "ModelConfig":
        if self.max_inflight is None:  # frozen: the one default that depends on another field
            object.__setattr__(self, "max_inflight", 1 if self.batching.max_size > 1 else 2)
        if isinstance(self.device, list) and len(self.device) != self.workers:
            raise ValueError(f"device lists {len(self.device)} devices for {self.workers} workers")
        if self.cores is not None:
            if len(self.cores) != self.workers:
                raise ValueError(f"cores lists {len(self.cores)} core sets for {self.workers} workers")
            if any(not cores for cores in self.cores):
                raise ValueError("every core set in 'cores' needs at least one core")
        if self.ready_min is not None and self.ready_min > self.workers:
            raise ValueError(f"ready_min {self.ready_min} is more than the {self.workers} workers")
        if self.weights == "mmap" and self.weights_file is None:
            raise ValueError("weights = \"mmap\" needs a weights_file to map")
        if self.weights_file is not None and self.source.startswith("torchscript:"):
            raise ValueError("weights_file needs a python: or export: source (an nn.Module)")
        if self.source.startswith("handler:") and self.weights_file is not None:
            raise ValueError("weights_file needs a python: or export: source; a handler loads "
                             "its own weights in load()")
        if (self.source.startswith("handler:") and self.probe.input is None
                and (self.warmup > 0 or self.probe.interval > 0)):
            raise ValueError("a handler's warm-up and probe need 'probe.input': a request's "
                             "inputs as the client sends them (a .json file), or set warmup = 0 "
                             "and probe.interval = 0")
        if self.warmup > 0 and not self.inputs and self.probe.input is None:
            raise ValueError("warm-up needs an example input: declare 'inputs' or 'probe.input' "
                             "(or set warmup = 0)")
        if self.prepare.steps and not self.inputs and self.probe.input is None:
            raise ValueError("prepare holds the prepared model to its FP32 answers on the probe "
                             "input: declare 'inputs' or 'probe.input'")
        return self

    @property
    def probes_enabled(self) -> bool:
        """Probes run when they have an interval and an input (declared inputs or a file)."""
        return self.probe.interval > 0 and bool(self.inputs or self.probe.input)

    def device_of(self, index: int) -> str:
        return self.device[index] if isinstance(self.device, list) else self.device


class CurveConfig(_Strict):
    """``[daemon.curve]``: every tcp frontend is a CURVE server (see supervisor/auth.py)."""

    server_secret_key: Path  # the server's .key_secret file (``modelwarden keygen``)
    client_keys: Path  # a directory of allowed clients' public .key files


class DaemonConfig(_Strict):
    runtime_dir: Path | None = None
    frontend: list[str] | None = None
    control: str | None = None
    curve: CurveConfig | None = None
    allow_plaintext_tcp: bool = False
    admin: str | None = None
    allow_oversubscription: bool = False
    shm: bool = True
    shm_threshold: int = Field(default=64 * 1024, ge=0)
    shm_group: str | None = None
    max_message_bytes: int = Field(default=256 * 1024**2, ge=1)
    max_connections: int | None = Field(default=None, ge=1)
    max_request_bytes_per_connection: int = Field(default=512 * 1024**2, ge=1)
    max_request_bytes: int = Field(default=2 * 1024**3, ge=1)
    max_unread_bytes_per_connection: int = Field(default=64 * 1024**2, ge=1)
    max_unread_bytes: int = Field(default=1024**3, ge=1)
    # Shares per identity (supervisor/routing/quotas.py; None: the default share of the daemon-wide cap)
    # and the bytes shared memory may make the daemon commit (supervisor/routing/buffers.py).
    max_connections_per_identity: int | None = Field(default=None, ge=1)
    max_buffers_per_identity: int | None = Field(default=None, ge=1)
    max_buffer_bytes: int | None = Field(default=None, ge=1, description=(
        "bytes of registered shared-memory buffers in all; default: half the host's memory"))
    max_buffer_bytes_per_identity: int | None = Field(default=None, ge=1)
    max_requests_per_identity: int | None = Field(default=None, ge=1)
    max_request_bytes_per_identity: int | None = Field(default=None, ge=1)
    max_shm_tensor_bytes: int = Field(default=1024**3, ge=1)
    max_shm_request_bytes: int = Field(default=2 * 1024**3, ge=1)
    graceful_timeout: float = Field(default=30.0, ge=0)
    fatal_exits: bool = False  # exit with shared.states.EXIT_MODEL_FATAL when a model is all FATAL
    heartbeat_interval: float = Field(default=0.5, gt=0)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"
    python_path: list[Path] = Field(default_factory=list)
    metrics: str | None = None  # "HOST:PORT": Prometheus /metrics, /healthz, /readyz (off if unset)
    allow_public_metrics: bool = False  # metrics on a non-loopback address (see docs/OPERATIONS.md)
    access_log: bool = False  # one line per answered request (logger modelwarden.access)

    @field_validator("shm_threshold", "max_message_bytes", "max_request_bytes_per_connection",
                     "max_request_bytes", "max_unread_bytes_per_connection", "max_unread_bytes",
                     "max_buffer_bytes", "max_buffer_bytes_per_identity",
                     "max_request_bytes_per_identity", "max_shm_tensor_bytes",
                     "max_shm_request_bytes", mode="before")
    @classmethod
    def _sizes(cls, value: Any) -> int | None:
        return parse_size(value)

    @field_validator("frontend")
    @classmethod
    def _endpoints(cls, value: list[str] | None) -> list[str] | None:
        for endpoint in value or []:
            check_endpoint(endpoint)
        return value

    @field_validator("metrics")
    @classmethod
    def _metrics_address(cls, value: str | None) -> str | None:
        if value is not None:
            parse_host_port(value)
        return value

    @model_validator(mode="after")
    def _metrics_exposure(self) -> "DaemonConfig":
        # Metrics carry model names, pids, memory and traffic: loopback unless the operator says.
        if self.metrics and not self.allow_public_metrics and not is_loopback(parse_host_port(self.metrics)[0]):
            raise ValueError(f"metrics = {self.metrics!r} is reachable from other hosts; use "
                             "127.0.0.1:PORT, or set allow_public_metrics = true")
        return self

    @field_validator("control")
    @classmethod
    def _control_not_tcp(cls, value: str | None) -> str | None:
        # Control commands stop and restart the daemon: only a socket file's permissions guard it.
        if value is not None and not value.startswith("ipc://"):
            raise ValueError(f"the control endpoint must be ipc://PATH, got {value!r}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _no_backend(cls, values: Any) -> Any:
        if isinstance(values, dict) and "backend" in values:
            raise ValueError("daemon.backend: there is no backend endpoint to set (each worker "
                             "is reached on a private socket pair); remove the key")
        return values

    @field_validator("admin")
    @classmethod
    def _private_endpoint(cls, value: str | None) -> str | None:
        # Only the file system can say who may connect (see docs/ARCHITECTURE.md, "Trust
        # boundary"): it never goes over tcp.
        if value is not None and not re.match(r"^ipc://.+", value):
            raise ValueError(f"endpoint {value!r}: must be ipc://PATH (in a directory only the "
                             "daemon's user can enter)")
        return value


def check_endpoint(endpoint: str) -> str:
    # unix://PATH: the local frontend (supervisor/routing/localfront.py), no ZeroMQ.
    if not re.match(r"^(ipc://.+|unix:///.+|tcp://[^:]+:[0-9]+)$", endpoint):
        raise ValueError(f"endpoint {endpoint!r}: use ipc://PATH, unix:///ABSOLUTE/PATH or "
                         "tcp://HOST:PORT")
    return endpoint


def is_exposed_tcp(endpoint: str) -> bool:
    """A tcp endpoint reachable from other hosts: anything but 127.0.0.0/8, ::1 and localhost."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name: assume it is reachable
        return True


class GatewayConfig(_Strict):
    """``[gateway]``: the KServe v2 (Open Inference Protocol) gateway process (gateway/)."""

    # "HOST:PORT", or "unix:/ABSOLUTE/PATH" (a Unix socket, mode 0600 or 0660 for shm_group)
    http: str | None = None  # the REST endpoint; absent: no REST
    grpc: str | None = None  # inference.GRPCInferenceService; absent: no gRPC
    token_file: Path | None = None  # bearer tokens the callers must present (gateway/access.py)
    tls_cert: Path | None = None  # PEM certificate chain: both listeners speak TLS
    tls_key: Path | None = None  # its PEM private key (mode 0600 or 0640)
    tls_client_ca: Path | None = None  # PEM CA(s): callers must present a certificate it signed
    allow_public: bool = False  # a non-loopback address without TLS and tokens (docs/OPERATIONS.md)
    max_message_bytes: int | None = Field(default=None, ge=1, description=(
        "largest request body or gRPC message; default: the daemon's max_message_bytes"))
    max_connections: int = Field(default=4096, ge=1, description=(
        "open connections per listener; more are closed as soon as they are accepted"))
    read_timeout: float = Field(default=30.0, gt=0, description=(
        "seconds for a whole request (headers and body) to arrive, and for a TLS or gRPC handshake"))
    max_json_bytes: int = Field(default=8 * 1024 * 1024, ge=1, description=(
        "largest JSON part of a REST request; larger tensors go as binary data (413 above it)"))
    max_requests_in_flight: int = Field(default=1024, ge=1, description=(
        "calls the gateway serves at once, all callers together"))
    max_bytes_in_flight: int | None = Field(default=None, ge=1, description=(
        "request bytes the gateway holds at once, all callers; default: 4 x max_message_bytes"))
    identity_share: float = Field(default=0.25, gt=0, le=1, description=(
        "the part of max_requests_in_flight and max_bytes_in_flight one caller may hold"))

    @field_validator("max_message_bytes", "max_json_bytes", "max_bytes_in_flight", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int | None:
        return parse_size(value)

    @field_validator("http", "grpc")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None and unix_socket_path(value) is None:
            parse_host_port(value)
        return value

    @model_validator(mode="after")
    def _exposure(self) -> "GatewayConfig":
        # Without a token anyone who reaches the port may call; like metrics, loopback (or a
        # Unix socket, whose mode decides) unless the operator says otherwise.
        if not self.http and not self.grpc:
            raise ValueError("[gateway] needs http = \"HOST:PORT\" or grpc = \"HOST:PORT\" (or "
                             "remove the section)")
        if self.http and self.http == self.grpc and not self.http.endswith(":0"):  # 0: any free port
            raise ValueError(f"http and grpc are both {self.http!r}: give each its own address")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: set both, or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key (client certificates are TLS)")
        guarded = self.tls_cert is not None and (self.token_file or self.tls_client_ca) is not None
        for address in (self.http, self.grpc):
            if (address and unix_socket_path(address) is None and not (self.allow_public or guarded)
                    and not is_loopback(parse_host_port(address)[0])):
                raise ValueError(f"{address!r} is reachable from other hosts: set tls_cert, tls_key "
                                 "and token_file (or tls_client_ca), or use 127.0.0.1:PORT or "
                                 "unix:PATH, or set allow_public = true (behind your own TLS proxy)")
        return self


def unix_socket_path(address: str) -> str | None:
    """The path of a ``unix:/ABSOLUTE/PATH`` listener address, None for ``HOST:PORT``."""
    if address.startswith("unix-abstract:"):
        raise ValueError(f"{address!r}: an abstract socket has no file mode, so anyone on the "
                         "host could connect; use unix:/ABSOLUTE/PATH")
    if not address.startswith("unix:"):
        return None
    path = address[len("unix:"):]
    if not path.startswith("/") or "\0" in path or len(path.encode()) > 107:
        raise ValueError(f"{address!r}: write unix:/ABSOLUTE/PATH (at most 107 bytes)")
    return path


class Settings(BaseSettings):
    """The whole file: ``[daemon]``, ``[[models]]`` and the optional ``[gateway]``."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True)

    daemon: DaemonConfig = Field(default_factory=DaemonConfig)
    gateway: GatewayConfig | None = None
    models: list[ModelConfig] = Field(default_factory=list)
    config_path: Path | None = None

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings,
                                   dotenv_settings, file_secret_settings):
        return (init_settings, _FileWithEnvOverrides(settings_cls))

    @model_validator(mode="after")
    def _unique_names(self) -> "Settings":
        names = [model.name for model in self.models]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"model name {name!r} is used twice")
        return self

    @property
    def base_dir(self) -> Path:
        return self.config_path.parent if self.config_path else Path.cwd()

    def resolve(self, path: Path | str) -> Path:
        path = Path(path).expanduser()
        return path if path.is_absolute() else self.base_dir / path

    @property
    def runtime_dir(self) -> Path:
        return runtime_dir(self.daemon.runtime_dir, self.base_dir)

    @property
    def frontends(self) -> list[str]:
        return self.daemon.frontend or default_frontends(self.runtime_dir)

    @property
    def control_endpoint(self) -> str:
        return control_endpoint(self.runtime_dir, self.daemon.control)

    @property
    def private_dir(self) -> Path:
        """Mode 0700 whatever ``shm_group`` says: the admin socket."""
        return self.runtime_dir / "private"

    @property
    def admin_endpoint(self) -> str:
        return admin_endpoint(self.runtime_dir, self.daemon.admin)

    def model(self, name: str) -> ModelConfig | None:
        return next((model for model in self.models if model.name == name), None)


def parse_host_port(value: str) -> tuple[str, int]:
    """``"127.0.0.1:9464"``, ``"[::1]:9464"`` -> (host, port); ValueError when it is not one."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not int(port) < 65536:  # 0: any free port
        raise ValueError(f"{value!r} is not HOST:PORT (e.g. \"127.0.0.1:9464\")")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host:
        raise ValueError(f"{value!r} names no host (\"0.0.0.0:{port}\" listens on every address)")
    return host, int(port)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class _FileWithEnvOverrides(PydanticBaseSettingsSource):
    """TOML file first, then MODELWARDEN_* variables merged in key by key."""

    def get_field_value(self, field, field_name):  # required by the base class; unused
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return raw_settings(_CURRENT_PATH.get("path"))


_CURRENT_PATH: dict[str, Path | None] = {}


def load_settings(path: str | Path | None = None) -> Settings:
    """Read, merge and validate the configuration; raises ConfigError, never ValidationError."""
    resolved = config_path(path)
    _CURRENT_PATH["path"] = resolved
    try:
        settings = Settings()
    except ValidationError as exc:
        raise _first_problem(exc, resolved) from None
    finally:
        _CURRENT_PATH.pop("path", None)
    check_files(settings)
    check_exposure(settings)
    return settings


def _first_problem(exc: ValidationError, path: Path | None) -> ConfigError:
    error = exc.errors()[0]
    key = format_key(error["loc"])
    models = read_toml(path).get("models", []) if path else []
    loc = error["loc"]
    if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int) and loc[1] < len(models):
        name = models[loc[1]].get("name") if isinstance(models[loc[1]], dict) else None
        if name:
            key += f" (model {name!r})"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    return ConfigError(key, message)


def format_key(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def check_files(settings: Settings) -> None:
    """Files the configuration names must exist now, not when a worker first needs them."""
    for index, model in enumerate(settings.models):
        scheme, _, rest = model.source.partition(":")
        where = f"models[{index}].source (model {model.name!r})"
        if scheme in ("torchscript", "export") and not settings.resolve(rest).is_file():
            raise ConfigError(where, f"model file {settings.resolve(rest)} does not exist")
        for key in ("input", "golden"):
            value = getattr(model.probe, key)
            if value is not None and not settings.resolve(value).is_file():
                raise ConfigError(f"models[{index}].probe.{key} (model {model.name!r})",
                                  f"file {settings.resolve(value)} does not exist")


def check_exposure(settings: Settings) -> None:
    """A frontend other hosts can reach must be CURVE, or plaintext by an explicit choice."""
    daemon = settings.daemon
    if daemon.curve is not None or daemon.allow_plaintext_tcp:
        return
    for endpoint in settings.frontends:
        if is_exposed_tcp(endpoint):
            raise ConfigError("daemon.frontend",
                              f"{endpoint} is plaintext tcp on a non-loopback address: anyone who "
                              "reaches it can use every model and read every tensor; configure "
                              "[daemon.curve] (see 'modelwarden keygen') or set "
                              "daemon.allow_plaintext_tcp = true")


@dataclass
class WorkerSpec:
    """The blueprint of one worker process: everything the child needs, nothing it computes."""

    model: ModelConfig
    slot: int
    generation: int
    cores: list[int]
    threads: int
    device: str
    supervisor_pid: int
    base_dir: str
    python_path: list[str] = field(default_factory=list)
    heartbeat_interval: float = 0.5
    shm_threshold: int = 64 * 1024
    max_mapped_bytes: int | None = None  # client buffers it may map in all (max_buffer_bytes)
    log_level: str = "INFO"
    log_format: str = "text"
    version: str = ""  # the model's version (supervisor/fleet/versions.py); in every reply header
    standby: int | None = None  # a standby's serial number until it is promoted (then None)
    # Fresh random bytes for every incarnation (supervisor.workerauth): the secret proves the
    # speaker on its link is the process we spawned. It travels only in this pickled spec,
    # through multiprocessing's spawn pipe: never argv, never environment.
    secret: bytes = field(default=b"", repr=False)

    @property
    def worker_id(self) -> str:
        if self.standby is not None:
            return f"{self.model.name}#standby{self.standby}"
        return f"{self.model.name}#{self.slot}"

    @property
    def placement(self) -> str:
        if self.device.startswith("cuda"):
            return self.device
        return f"cpu[{format_cores(self.cores)}]"
