"""Configuration of the kvstore service (``TANDEM_KVSTORE_*`` env vars or flags)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.common.settings import TandemSettings
from services.kvstore.validation import MAX_BLOCKS_PER_WORKER, MAX_ITEMS_PER_CALL


class KVStoreSettings(TandemSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_KVSTORE_")

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(50051, ge=0, le=65535, description="port to bind (0 = any free port)")
    lease_ttl_s: float = Field(10.0, gt=0, description="worker lease length; a lapsed lease drops the worker")
    max_tokens: int = Field(1 << 20, ge=1, description="longest token list accepted in one call")
    max_receive_bytes: int = Field(16 << 20, ge=1024, description="largest request message in bytes")
    max_concurrent_rpcs: int = Field(1024, ge=1, description="RPCs handled at once; more are refused")
    grace_s: float = Field(5.0, ge=0, description="seconds in-flight RPCs get on shutdown")
    event_queue: int = Field(4096, ge=16, description="events buffered per WatchEvents stream")
    events_per_worker: int = Field(
        0, ge=0, description="block events kept per worker for WatchEvents (0 = events off: no keys hashed)"
    )
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus /metrics port on host (unset = off, 0 = any free port)")
    max_num_blocks: int = Field(1 << 20, ge=1, le=MAX_BLOCKS_PER_WORKER, description="largest num_blocks a worker may register (each block costs the kvstore a record)")
    max_workers: int = Field(1024, ge=1, description="registered workers at most (bounds every Match and ListWorkers reply)")
    max_items_per_call: int = Field(MAX_ITEMS_PER_CALL, ge=1, le=1 << 16, description="most items in one Extend or Trim call")
    backend: Literal["memory", "redis"] = Field(
        "memory", description="where state lives: memory (this process only) or redis (durable, with standby)"
    )
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for --backend redis: redis://HOST:PORT/DB")
    redis_prefix: str = Field("tandem:kv:", min_length=1, description="prefix of every Redis key of this kvstore")
    redis_lease_ms: int = Field(
        1500, ge=200, le=60_000, description="leader lease in Redis; a standby takes over this long after the leader dies"
    )
    snapshot_every: int = Field(
        10_000, ge=0, description="journal entries between snapshots in Redis (0 = never: recovery replays everything)"
    )

    def store_args(self) -> dict:
        """``KVStore`` constructor arguments these settings give (the one mapping, for both backends)."""
        return dict(
            lease_ttl_s=self.lease_ttl_s,
            max_tokens=self.max_tokens,
            events_per_worker=self.events_per_worker,
            max_num_blocks=self.max_num_blocks,
            max_items=self.max_items_per_call,
            max_workers=self.max_workers,
        )

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be redis://HOST:PORT/DB, rediss://HOST:PORT/DB (TLS) or unix:///path/to/socket")
        return value
