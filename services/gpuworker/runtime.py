"""The engine side of a worker, built from its settings: model and pools (``build.py``), warm-up,
the kvstore link that carries reservation verbs, its courier, and the :class:`EngineRunner`.

It is the same whether it lives in the gRPC process (``--no-engine-process``) or in an engine
process of its own (``engine_process.py``); what the gRPC side needs to know about it travels as
:class:`EngineFacts`, plain values that pickle.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from services.common.errors import TandemError
from services.common.spec import SpecMode
from services.common.startup import StartupError
from services.gpuworker.build import build_engine
from services.gpuworker.engine.report import StepReport
from services.gpuworker.kvstore_carrier import CarrierGone, LinkRecipe, ProcessCarrier, ThreadCarrier
from services.gpuworker.kvstore_courier import KVStoreCourier
from services.gpuworker.kvstore_link import KVStoreLink, ReservationBlockSource
from services.gpuworker.runner import EngineRunner, Outbox
from services.gpuworker.settings import WorkerSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineFacts:
    """What the gRPC side reports (Info, kvstore registration) about the engine it serves."""

    model_id: str  # target fingerprint (+ draft fingerprint): the KV-cache namespace
    spec_mode: SpecMode
    num_blocks: int
    vocab_size: int
    max_seq_len: int
    max_draft_tokens: int  # 0 without a draft
    num_draft_tokens: int  # the default k advertised to routers (WorkerSettings.default_draft_tokens)
    device: str
    graphs: int  # CUDA graphs captured at warm-up


def build_runtime(
    settings: WorkerSettings,
    link: KVStoreLink,
    *,
    on_step: Callable[[StepReport, float, float], None] | None = None,
    on_idle: Callable[[float], None] | None = None,
    outbox: Outbox | None = None,
    on_disown: Callable[[str], None] | None = None,
    inbox: Connection | None = None,
) -> tuple[EngineRunner, EngineFacts]:
    """Load, build and warm up the engine (blocking: call it off the event loop) and wrap it in
    an :class:`EngineRunner` that is not started yet. ``StartupError`` for a model that cannot
    load or run, with one line."""
    if settings.gil_switch_interval_ms is not None:
        sys.setswitchinterval(settings.gil_switch_interval_ms / 1e3)
    try:
        courier = build_courier(settings, link)
    except CarrierGone as exc:
        raise StartupError(f"cannot start the kvstore carrier process: {exc.message}") from None
    source = ReservationBlockSource(courier)
    try:
        built = build_engine(settings, lambda _num_blocks: source)
    except TandemError as exc:  # a missing or unusable model folder, no room for KV: one line, not a traceback
        courier.close()
        raise StartupError(f"cannot load model {settings.model!r}: {exc.message}") from None
    engine, target, draft = built.engine, built.target, built.draft
    graphs = 0
    if settings.warmup:
        # kernels compiled and graphs captured before health says SERVING: the first request
        # then costs what any other does
        started = time.perf_counter()
        graphs = engine.warmup(lambda msg: log.info("warm-up: %s", msg))
        log.info("warm-up done in %.1fs (%d CUDA graphs)", time.perf_counter() - started, graphs)
    runner = EngineRunner(
        engine, link, source, courier, max_running=settings.max_running,
        extend_watermark_blocks=settings.extend_watermark_blocks, extend_chunk_blocks=settings.extend_chunk_blocks,
        on_step=on_step, on_idle=on_idle, outbox=outbox, on_disown=on_disown, inbox=inbox,
    )
    facts = EngineFacts(
        # the draft's weights shape the draft KV, so they are part of the cache namespace too
        model_id=target.fingerprint + (f"+{draft.fingerprint}" if draft is not None else ""),
        spec_mode=built.spec_mode,
        num_blocks=built.num_blocks,
        vocab_size=target.config.vocab_size,
        max_seq_len=engine.max_seq_len,
        max_draft_tokens=settings.max_draft_tokens if draft is not None else 0,
        num_draft_tokens=settings.default_draft_tokens(
            draft.config.num_draft_tokens if draft is not None else None, has_draft=draft is not None),
        device=str(engine.device),
        graphs=graphs,
    )
    return runner, facts


def build_courier(settings: WorkerSettings, link: KVStoreLink) -> KVStoreCourier:
    """The courier of the engine's kvstore verbs, its carrier as ``settings`` say: a process of
    its own with its own link to the same kvstore, or a thread over ``link``."""
    if not settings.carrier_process:
        return KVStoreCourier(ThreadCarrier(link))
    recipe = LinkRecipe(link.address, link.timeout_s, settings.worker_id, settings.model_dump())
    courier = KVStoreCourier(ProcessCarrier(recipe))
    courier.on_gone = _carrier_gone
    return courier


def _carrier_gone(exc: CarrierGone) -> None:
    """The carrier process died: no kvstore verb of this engine can be sent any more. Exit, so
    the worker's gRPC process sees the engine process gone and stops, and a supervisor starts a
    new incarnation (what is reserved dies with the lease)."""
    log.critical("%s; the engine process exits", exc.message)
    logging.shutdown()
    os._exit(70)
