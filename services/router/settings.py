"""Configuration of the router service (``TANDEM_ROUTER_*`` env vars or ``tandem router`` flags)."""

from __future__ import annotations

import socket
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.settings import TandemSettings
from services.common.spec import check_draft_tokens


class RouterSettings(TandemSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_ROUTER_")

    # --- serving
    port: int = Field(50050, ge=0, le=65535, description="port to bind (0 = any free port)")
    kvstore: str = Field("127.0.0.1:50051", min_length=1, description="kvstore host:port, or a comma-separated list (a leader and its standbys: the one that leads is used)")
    model: str = Field("auto", min_length=1, description="model folder whose tokenizer to load, 'tiny' (byte-level), or 'auto': the model the first registered worker serves (workers serving another model are refused)")
    revision: str = Field("", description="hub revision (branch, tag or commit) of a hub-id model whose tokenizer the router loads (--model, or learned with auto): give the workers' --revision ('' = main)")
    model_id: str = Field("", description="only route to workers registered with this model fingerprint ('' = any)")
    max_concurrent_rpcs: int = Field(1024, ge=1, description="RPCs handled at once; more are refused")
    http_port: int | None = Field(None, ge=0, le=65535, description="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models) on host:this port (unset = off, 0 = any free port)")
    procs: int = Field(1, ge=1, le=256, description="router processes serving the same gRPC (and HTTP) port through SO_REUSEPORT, each with its own event loop, kvstore channel and worker directory; the kernel spreads client *connections* over them (see services/router/procs.py); metrics of process i on metrics_port + i")
    front_trace: str = Field("", description="debug: append each request's front timestamps (receive, dispatch, first token, first write; JSON lines, see services/router/front_trace.py) to this file ('' = off)")

    worker_stream_window_bytes: int = Field(
        64, ge=0, le=1 << 24,
        description="how much of each worker stream the router buffers unread (HTTP/2 stream window; 0 = gRPC's auto-tuned window). When the router, or a client it streams to, reads slower than the engine decodes, the worker stops at this bound and merges the tokens that wait into its next message, instead of the router falling ever further behind (see services/common/channels.stream_window_options). The window must cover the router-worker link's bandwidth × round trip: raise it for a worker on a distant host",
    )

    # --- request limits
    max_new_tokens: int = Field(4096, ge=1, description="largest max_new_tokens a request may ask for")
    max_prompt_tokens: int = Field(1 << 17, ge=1, description="longest prompt accepted, in tokens")
    num_draft_tokens: int | None = Field(
        None, ge=0, description="draft tokens per step (k) when a request does not say (unset: the chosen worker's default, its Info.num_draft_tokens, which knows its model, draft and device; 3 for a worker that advertises none); capped by each worker's own maximum"
    )
    max_draft_tokens: int = Field(16, ge=0, description="largest num_draft_tokens a request may ask for")

    # --- tenants
    tenants: str = Field("", description="bearer tokens: 'tokA=alice,tokB=bob', inline JSON or a JSON file path ('' = demo mode: everyone is 'public')")
    salt_secret_file: str = Field("", description="file holding the secret (>= 16 bytes) that keys tenants' cache salts; every router of a deployment needs the same one ('' = salt_secret, else random per process)")
    salt_secret: str = Field("", description="the salt secret itself (prefer salt_secret_file or the env var; never put it on a command line)")
    shared_tenants: str = Field("", description="comma-separated tenants that share one cache namespace (opt-in cross-tenant reuse)")

    # --- routing policy
    policy: Literal["kv_aware", "round_robin"] = Field("kv_aware", description="kv_aware = reuse vs load cost (policy_alpha/beta/gamma); round_robin = rotate over workers, ignoring reuse and load (a baseline)")
    policy_alpha: float = Field(1.0, ge=0, description="cost per prompt block not reusable on a worker")
    policy_beta: float = Field(0.01, ge=0, description="cost per block in use on a worker")
    policy_gamma: float = Field(2.0, ge=0, description="cost per request running or queued on a worker")
    policy_seed: int | None = Field(None, description="seed of the tie-breaking RNG (unset = from the OS)")

    # --- retries, queueing, deadlines
    max_attempts: int = Field(3, ge=1, description="workers tried per request when one fails before its first token")
    max_queued: int = Field(256, ge=0, description="requests waiting for capacity at once; more get RESOURCE_EXHAUSTED")
    queue_retry_s: float = Field(0.05, gt=0, description="first wait between capacity retries (doubles up to queue_retry_max_s)")
    queue_retry_max_s: float = Field(0.5, gt=0, description="longest wait between capacity retries")
    max_queue_wait_s: float = Field(30.0, ge=0, description="longest a request waits for capacity (also bounded by its deadline)")
    kvstore_timeout_s: float = Field(2.0, gt=0, description="deadline cap of each kvstore call")
    kvstore_outage_wait_s: float = Field(
        10.0, ge=0, description="how long a new request waits for an unreachable kvstore (failover) or for a worker to (re-)register before UNAVAILABLE"
    )
    worker_probe_timeout_s: float = Field(1.0, gt=0, description="deadline of worker health checks and abort probes")
    max_request_s: float = Field(600.0, gt=0, description="deadline of a worker Generate call when the client set none (and its cap)")
    registry_ttl_s: float = Field(2.0, ge=0, description="how long a kvstore ListWorkers answer is reused")
    failed_worker_cooldown_s: float = Field(5.0, ge=0, description="a worker that failed is avoided by new requests for this long")

    # --- TLS (PEM file paths; empty = plaintext)
    tls_cert_file: str = Field("", description="server certificate (enables TLS)")
    tls_key_file: str = Field("", description="server private key")
    tls_client_ca_file: str = Field("", description="CA of client certificates (enables mTLS: clients must present one)")
    upstream_ca_file: str = Field("", description="CA to verify the kvstore and workers (enables TLS to them)")
    upstream_cert_file: str = Field("", description="client certificate presented to the kvstore and workers (mTLS)")
    upstream_key_file: str = Field("", description="private key of upstream_cert_file")
    # --- failure detection
    idle_timeout_s: float = Field(60.0, gt=0, description="a worker stream that sends nothing for this long while the router reads it (prefill included) fails with UNAVAILABLE (checked every quarter of it; a stream whose client has not taken its last delta is not timed)")

    @model_validator(mode="after")
    def _consistent(self) -> RouterSettings:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file (mTLS) needs tls_cert_file and tls_key_file")
        if bool(self.upstream_cert_file) != bool(self.upstream_key_file):
            raise ValueError("upstream_cert_file and upstream_key_file go together")
        if (self.upstream_cert_file or self.upstream_key_file) and not self.upstream_ca_file:
            raise ValueError("upstream_cert_file needs upstream_ca_file (TLS to the kvstore and workers)")
        check_draft_tokens(self.num_draft_tokens, self.max_draft_tokens)
        if self.procs > 1 and not hasattr(socket, "SO_REUSEPORT"):
            raise ValueError("procs > 1 needs SO_REUSEPORT (Linux), which this platform lacks")
        if self.metrics_port and self.metrics_port + self.procs - 1 > 65535:
            raise ValueError("metrics_port + procs - 1 (process i serves metrics on metrics_port + i) exceeds 65535")
        if self.queue_retry_s > self.queue_retry_max_s:
            raise ValueError("queue_retry_s must not exceed queue_retry_max_s")
        return self
