"""Configuration of the gpuworker service (``TANDEM_WORKER_*`` env vars or flags)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.settings import TandemSettings
from services.common.spec import DEFAULT_DRAFT_TOKENS, check_draft_tokens


class WorkerSettings(TandemSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_WORKER_")

    port: int = Field(50061, ge=0, le=65535, description="port to bind (0 = any free port)")
    advertise: str = Field("", description="host:port the router should dial (default: bound host:port)")
    kvstore: str = Field("127.0.0.1:50051", description="kvstore host:port, or a comma-separated list (a leader and its standbys: the one that leads is used)")
    worker_id: str = Field("worker0", min_length=1, max_length=128, description="name in the kvstore registry")
    model: str = Field("tiny", description="model folder (config.json + *.safetensors), hub id (org/name), 'demo' (the shipped demo model) or 'tiny' (random weights, for tests)")
    revision: str = Field("", description="hub revision (branch, tag or commit) of --model ('' = main)")
    served_model_name: str = Field("", max_length=128, description="explicit model identity: mixed into the KV-cache namespace with the weights' digest, so two deployments share cached KV only under the same name ('' = the digest alone)")
    spec_mode: Literal["none", "eagle3", "mtp"] = Field("eagle3", description="draft kind")
    draft_model: str = Field("", description="the draft: a folder or hub id (public EAGLE-3 layout, or tandem_draft.json for MTP), 'random' for seeded random weights (benchmarks only), '' = the model folder's own (an error if it has none)")
    draft_revision: str = Field("", description="hub revision of --draft-model ('' = main)")
    mtp_depth: int = Field(1, ge=1, le=8, description="chained MTP modules K (mtp only)")
    block_size: int = Field(16, ge=1, le=1024, description="positions per KV block (power of two)")
    num_blocks: int = Field(0, ge=0, description="paired KV blocks; 0 = size from kv_memory_mb")
    kv_memory_mb: float = Field(256.0, gt=0, description="memory for target + draft KV pools when num_blocks = 0 (CPU default)")
    max_num_blocks: int = Field(
        1 << 18, ge=1, description="cap on blocks sized from memory (the kvstore keeps a record per block; a tiny model in 0.9 of a large GPU would make millions)"
    )
    kv_memory_fraction: float | None = Field(
        None, gt=0, le=1, description="when num_blocks = 0: this fraction of the device memory free after the model loaded (unset: 0.9 on CUDA, kv_memory_mb on CPU)"
    )
    backend: Literal["torch", "flashinfer"] = Field("torch", description="attention backend")
    device: str = Field("cpu", description="torch device, e.g. cpu or cuda:0")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="model and KV dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    max_batch_tokens: int | None = Field(
        None, ge=2, description="target tokens per engine step (unset: 2048 on CUDA, where a prefill chunk is one eager forward whatever its size; 256 on CPU)"
    )
    chunk_size: int | None = Field(
        None, ge=1, description="prompt positions per request per step (unset: max_batch_tokens on CUDA, 64 on CPU)"
    )
    gil_switch_interval_ms: float | None = Field(
        None, gt=0, le=100, description="Python's thread switch interval in this process (sys.setswitchinterval; unset: Python's 5 ms). The engine thread and the gRPC event loop share the GIL"
    )
    engine_process: bool | None = Field(
        None, description="run the engine in an OS process of its own, beside the gRPC process (unset: on for CUDA, where the engine and gRPC streaming would share one GIL; off on CPU)"
    )
    kvstore_carrier: Literal["thread", "process"] | None = Field(
        None, description="what sends the engine's kvstore verbs: 'process', an OS process of its own (the engine thread then shares its GIL with nothing: a courier thread beside it cost a third of a served step at 64 requests, docs/benchmarks.md), or 'thread', a thread of the engine's process (unset: 'process' where the engine runs in its own process, else 'thread')"
    )
    max_batch_size: int = Field(64, ge=1, description="requests per step")
    prefill_wait_steps: int = Field(0, ge=0, le=64, description="hold a new prompt up to this many engine steps while others decode, so one forward prefills several (TGI's max_waiting_tokens; 0: start every prompt at once)")
    prefill_batch: int = Field(4, ge=1, le=1024, description="with prefill_wait_steps: release the waiting prompts as soon as this many wait")
    max_draft_tokens: int = Field(8, ge=0, le=32, description="largest k a request may ask for")
    num_draft_tokens: int | None = Field(
        None, ge=0, le=32, description="draft tokens per step (k) a router asks for when neither the request nor the router's own --num-draft-tokens says; advertised in Info (unset: the draft's recommendation (its config's num_draft_tokens, docs/drafts.md) capped by max_draft_tokens, else 3; 0 without a draft)"
    )
    max_running: int = Field(256, ge=1, description="requests admitted at once; more get RESOURCE_EXHAUSTED")
    stream_interval: int = Field(
        1, ge=1, le=64, description="after a request's first token (sent at once), a Generate message goes out once this many tokens have gathered, or at the end (SGLang's and vLLM's stream interval): fewer messages through the router and to the client (plain decoding sends one per request per step), for coarser streaming; 1: every step's tokens as they come. A stop string is seen by the router up to N - 1 steps late, which the worker computes and counts in decode_steps; the router's stream idle timeout must outlast N steps"
    )
    heartbeat_s: float = Field(1.0, gt=0, description="seconds between kvstore heartbeats")
    rpc_timeout_s: float = Field(5.0, gt=0, description="deadline of each kvstore call")
    seed: int = Field(0, description="seed of the built-in tiny model's weights")
    cuda_graphs: bool = Field(True, description="capture decode, verify and draft-chain forwards in CUDA graphs at start-up (CUDA only; ignored on CPU)")
    overlap_steps: bool = Field(True, description="launch the next step before reading back plain greedy decode tokens (the host plans step N+1 while the device runs step N), and read a fused speculative step's verdict at the start of the next step (streaming and publishing run while the device does); output is unchanged")
    fused_spec_steps: bool = Field(True, description="run a greedy EAGLE-3 speculative step (draft chain, verify, verdict, draft fill) as one forward, one CUDA graph launch and one read-back, when graphs are on; output is unchanged")
    fused_spec_graphs: Literal["one", "split"] = Field("split", description="how a fused speculative step launches: 'split' (default): each draft-chain position's graph right after its own plan and the verify + fill graph last, so the device runs while the later plans are made (k_max - 1 more graphs per batch bucket; on an H100 the step was 1.11-1.16x its parts against 1.20-1.24x with 'one'); 'one' graph after all k attention plans; output is unchanged")
    warmup: bool = Field(True, description="compile kernels and capture graphs before health says SERVING")
    extend_watermark_blocks: int = Field(2, ge=0, le=1024, description="extend a request's KV capacity ahead of need once fewer than this many blocks of headroom are left")
    extend_chunk_blocks: int = Field(4, ge=1, le=1024, description="blocks of headroom each ahead-of-need Extend asks for")
    forced_acceptance: int | None = Field(None, ge=0, le=32, description="BENCHMARKS ONLY: accept exactly this many drafts per verify, whatever they are (output is no longer the model's)")

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def separate_engine_process(self) -> bool:
        """``engine_process`` as set, or its device default."""
        return self.engine_process if self.engine_process is not None else self.on_cuda

    @property
    def carrier_process(self) -> bool:
        """``kvstore_carrier`` as set, or its default: a process beside an engine process."""
        return self.kvstore_carrier == "process" if self.kvstore_carrier is not None else self.separate_engine_process

    @property
    def step_tokens(self) -> int:
        """``max_batch_tokens`` as set, or its device default."""
        return self.max_batch_tokens if self.max_batch_tokens is not None else (2048 if self.on_cuda else 256)

    @property
    def prefill_chunk(self) -> int:
        """``chunk_size`` as set, or its device default."""
        if self.chunk_size is not None:
            return self.chunk_size
        return self.step_tokens if self.on_cuda else 64

    def default_draft_tokens(self, draft_recommends: int | None, has_draft: bool) -> int:
        """The k this worker advertises (pure): 0 without a draft; ``num_draft_tokens`` when
        set; else the draft folder's recommendation, else ``DEFAULT_DRAFT_TOKENS``; never above
        ``max_draft_tokens`` (a folder may recommend more than this worker allows: capped, not refused)."""
        if not has_draft:
            return 0
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens  # checked against max_draft_tokens at start
        k = DEFAULT_DRAFT_TOKENS if draft_recommends is None else draft_recommends
        return min(k, self.max_draft_tokens)

    @model_validator(mode="after")
    def _check(self) -> "WorkerSettings":
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.backend == "flashinfer" and not self.device.startswith("cuda"):
            raise ValueError("the flashinfer backend needs a CUDA device (--device cuda:0)")
        if self.backend == "flashinfer" and self.torch_dtype_name == "float32":
            raise ValueError("the flashinfer backend runs bfloat16 or float16, not float32 (--dtype auto or bfloat16)")
        if self.draft_model and self.spec_mode == "none":
            raise ValueError("--draft-model needs --spec-mode eagle3 or mtp")
        if self.mtp_depth != 1 and self.spec_mode != "mtp":
            raise ValueError(f"--mtp-depth {self.mtp_depth} needs --spec-mode mtp")
        check_draft_tokens(self.num_draft_tokens, self.max_draft_tokens)
        if self.num_draft_tokens and self.spec_mode == "none":
            raise ValueError("--num-draft-tokens above 0 needs a draft (--spec-mode eagle3 or mtp)")
        if self.forced_acceptance is not None and self.spec_mode == "none":
            raise ValueError("--forced-acceptance needs a draft (--spec-mode eagle3 or mtp)")
        return self

    @property
    def torch_dtype_name(self) -> str:
        """``dtype`` with ``auto`` resolved: bfloat16 on CUDA, float32 elsewhere."""
        if self.dtype == "auto":
            return "bfloat16" if self.device.startswith("cuda") else "float32"
        return self.dtype
