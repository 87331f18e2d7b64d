"""Configuration of the buffer (gate, store, durable log, sample limits, service and client).

`BufferConfig` is composed into the run's config tree by `services/config.py`. CURVE keys are
never part of it: the config names key *files* (or nothing), and the keys themselves may also come
from environment variables (see `buffer.auth`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GateConfig(_Strict):
    """The η admission gate. batch_size B is counted in groups (one group = one prompt)."""

    batch_size: int = Field(8, ge=1)
    # 2, not AReaL's 4 (the `coding` preset): with rollouts outpacing the learner the window stays
    # full, and in the embedded run eta = 4 then learned less than 1 or 2 (docs/results.md)
    eta: Union[int, None, Literal["auto"]] = Field(
        2, description="max staleness in versions; 0 = synchronous, None = unbounded, auto = from the measured "
        "drift per version (buffer/eta_control.py), starting at eta_min")
    drift_budget: float = Field(
        0.02, gt=0, description="eta auto: the largest staleness drift (k3, nats per token) a sample may carry "
        "at training time; eta = floor(budget / drift per version)")
    eta_min: int = Field(1, ge=0, description="eta auto: the smallest eta")
    eta_max: int = Field(8, ge=0, description="eta auto: the largest eta")
    max_concurrent: int = Field(64, ge=1, description="max permits held at once (generations in flight)")
    permit_lease_s: float = Field(600.0, gt=0, description="a permit not used or released by then is reclaimed")

    @model_validator(mode="after")
    def _eta_in_range(self):
        if isinstance(self.eta, int) and self.eta < 0:
            raise ValueError(f"eta must be >= 0, None or 'auto', got {self.eta}")
        if self.eta_min > self.eta_max:
            raise ValueError(f"eta_min ({self.eta_min}) exceeds eta_max ({self.eta_max})")
        return self

    @property
    def adaptive(self) -> bool:
        return self.eta == "auto"

    @property
    def initial_eta(self) -> int | None:
        """The η the gate starts with (eta_min under `auto`)."""
        return self.eta_min if self.adaptive else self.eta


class StoreConfig(_Strict):
    capacity_groups: int = Field(4096, ge=1, description="groups held (ready + leased); pushes beyond are refused")
    lease_s: float = Field(300.0, gt=0, description="a pulled batch not acked by then goes back to the queue")
    remembered_settled_groups: int = Field(
        100_000, ge=1, description="consumed or dropped groups whose ids are kept (about 100 bytes each) so a "
        "retried push of one is answered as a duplicate; a push retried later is refused as unknown_permit")
    max_bytes: int = Field(
        8 << 30, ge=1, description="bytes of packed groups held (ready + leased); a push beyond is refused "
        "(store_full) and no permit is granted while the store is full: accepted data is never dropped. The group "
        "count alone let a few large groups fill the machine's memory")


class LogConfig(_Strict):
    """The optional durable append-only log of pushes, acks and gate events."""

    path: Path | None = None
    fsync: Literal["always", "interval"] = "always"
    fsync_interval_ms: int = Field(100, ge=1)
    compact_min_bytes: int = Field(64 << 20, ge=0, description="compact once the log is this big and twice its size after the last compaction")
    segment_bytes: int = Field(64 << 20, ge=1, description="large group payloads go to segment files of about this "
                               "size beside the log; a segment is deleted once none of its groups is live")


class SampleLimits(_Strict):
    max_group_size: int = Field(1024, ge=1)
    max_prompt_tokens: int = Field(131072, ge=1)
    max_response_tokens: int = Field(131072, ge=1)
    max_metadata_items: int = Field(64, ge=0)
    max_string_chars: int = Field(4096, ge=1)
    max_message_bytes: int = Field(512 << 20, ge=1024)
    max_batch_groups: int = Field(65536, ge=1)
    # A token id the model has no embedding for is a device-side assert in the learner (every
    # resume would pull it again): a run fills these two from its model (services/config.py).
    vocab_size: int | None = Field(
        None, ge=1, description="token ids (prompt and response) must be below this; None: unchecked (a run "
        "fills it from the model's config)")
    max_sequence_tokens: int | None = Field(
        None, ge=1, description="prompt + response tokens of one sample; None: unchecked (a run fills it with the "
        "rollout engine's context: rollout.engine.max_model_len, else the model's)")
    num_experts: int | None = Field(
        None, ge=1, description="MoE: routed expert ids must be below this; None: unchecked (the learner checks "
        "them against its model)")
    # msgpack decodes a header whole before any type check, and tiny items become large objects
    # (2 MB of empty maps are 144 MB of dicts): headers are small, so they are bounded in bytes.
    max_header_bytes: int = Field(
        1 << 20, ge=1024, description="bytes of a msgpack header (a request's or a group's); the arrays travel "
        "in frames of their own and are bounded by max_message_bytes")
    max_frames: int = Field(
        1 + 1024, ge=2, description="frames of one request: its header and one packed group per group pushed")


class CurveConfig(_Strict):
    """CURVE authentication. Key files come from `python -m buffer keygen DIR`; any key may instead
    be given by an environment variable (buffer.auth.ENV_*), which wins over the file."""

    enabled: bool = False
    server_public_key_file: Path | None = None
    server_secret_key_file: Path | None = None
    client_public_key_file: Path | None = None
    client_secret_key_file: Path | None = None
    authorized_clients_dir: Path | None = Field(
        None, description="public keys of the allowed clients, one folder per role (worker/, learner/, admin/); "
        "None = any client that knows the server key, with every right (loopback, or allow_any_client)"
    )
    allow_any_client: bool = Field(
        False, description="on a non-loopback bind without authorized_clients_dir, admit any client that knows "
        "the server's public key (it can call every operation); refused unless set on purpose")
    worker_client_secret_key_file: Path | None = Field(
        None, description="the key the run's rollout workers use (role worker); None: client_secret_key_file")


class PerClientLimits(_Strict):
    """What one client may hold, so no client can take the buffer from the others. A client is one
    connection (its ZMQ routing identity) for permits and waiting requests; for the version, one
    CURVE key (with role folders) or, without, every keyless client together: a client that
    reconnects must not get a fresh budget."""

    max_permits: int = Field(64, ge=1, description="permits one connection may hold at once; a request beyond gets "
                             "fewer permits, or is refused (too_many_permits) when it holds this many")
    max_waiting: int = Field(16, ge=1, description="long polls (acquire, pull) one connection may have parked; more "
                             "are refused (too_many_waiting); the run's clients park one at a time")
    version_rate_per_s: float = Field(
        1.0, gt=0, description="the learner version's rise per client is a token bucket: max_version_jump tokens "
        "(a resume's burst), refilled at this rate and by one token per batch the client acks (the learner's pace: "
        "one version per consumed batch); a rise beyond the tokens is refused (version_jump)")


class ClientConfig(_Strict):
    request_timeout_s: float = Field(10.0, gt=0)
    retries: int = Field(5, ge=0)
    retry_backoff_s: float = Field(0.1, ge=0)


_RUN_ONLY_KEYS = {"max_restarts"}  # keys of a run config's buffer section (services.config.RunBufferConfig)


class BufferConfig(_Strict):
    transport: Literal["zmq", "ray"] = "zmq"
    host: str = "127.0.0.1"
    port: int = Field(5557, ge=0, le=65535)
    ipc_path: Path | None = Field(
        None, description="serve on this Unix socket instead of host:port (one-node runs): its folder must be "
        "yours and mode 0700 (checked at bind), so file permissions keep other local users out. The run's "
        "supervisor uses one in RUN_DIR when CURVE is off; `etarl buffer serve` keeps tcp on host:port unless set")
    allow_remote_without_auth: bool = False
    max_version_jump: int = Field(
        16, ge=1, description="set_version (or an ack with a version) and recover may move the learner version "
        "at most this far ahead in one request: a wrong or hostile call cannot close the gate for good")
    max_deliveries: int | None = Field(
        2, ge=1, description="a group whose lease failed this many times (expired: the learner crashed, or the "
        "lease was in flight at a restart and never acked; or nacked as failed: the learner refused or crashed on "
        "the batch) is dropped as poisoned by the next pull (counted, logged, its ticket reissued), not pulled "
        "forever; None: never")
    gate: GateConfig = GateConfig()
    store: StoreConfig = StoreConfig()
    log: LogConfig = LogConfig()
    limits: SampleLimits = SampleLimits()
    curve: CurveConfig = CurveConfig()
    per_client: PerClientLimits = PerClientLimits()
    client: ClientConfig = ClientConfig()

    @model_validator(mode="after")
    def _loopback_unless_authenticated(self):
        if self.host not in LOOPBACK_HOSTS and not self.curve.enabled and not self.allow_remote_without_auth:
            raise ValueError(
                f"buffer.host={self.host!r} is not loopback and CURVE is off; enable buffer.curve "
                "or set buffer.allow_remote_without_auth=true"
            )
        curve = self.curve
        if (self.host not in LOOPBACK_HOSTS and curve.enabled and curve.authorized_clients_dir is None
                and not curve.allow_any_client):
            raise ValueError(
                f"buffer.host={self.host!r} is not loopback and buffer.curve.authorized_clients_dir is unset: CURVE "
                "would encrypt but admit any holder of the server's public key, with every right (recover, "
                "set_version). Set buffer.curve.authorized_clients_dir (`etarl buffer keygen DIR` makes one with a "
                "folder per role), or buffer.curve.allow_any_client=true on purpose"
            )
        return self

    @property
    def endpoint(self) -> str:
        if self.ipc_path is not None:
            return f"ipc://{self.ipc_path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    @classmethod
    def from_yaml(cls, path: str | Path) -> "BufferConfig":
        """Load a buffer config file, or the `buffer:` section of a run config file."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"buffer config file {str(path)!r} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
        section = ""
        if isinstance(data.get("buffer"), dict):
            # A run's buffer section also says how often the run restarts a dead buffer: not the service's business.
            data = {k: v for k, v in data["buffer"].items() if k not in _RUN_ONLY_KEYS}
            section = " (section buffer)"
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ValueError(f"{path}{section}: {exc}") from None

    @classmethod
    def synchronous(cls, batch_size: int = 8) -> "BufferConfig":
        """η = 0: every sample is generated by the current weights (on-policy)."""
        return cls(gate=GateConfig(batch_size=batch_size, eta=0))

    @classmethod
    def math(cls, batch_size: int = 8) -> "BufferConfig":
        """AReaL's recommendation for math tasks: η = 8."""
        return cls(gate=GateConfig(batch_size=batch_size, eta=8))

    @classmethod
    def coding(cls, batch_size: int = 8) -> "BufferConfig":
        """AReaL's recommendation for coding tasks: η = 4."""
        return cls(gate=GateConfig(batch_size=batch_size, eta=4))
