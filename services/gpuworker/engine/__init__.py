"""The gpuworker engine: continuous batching of chunked prefill and one-model speculative decoding
over the paired target/draft KV pools.

Public API::

    Engine(target, draft, backend, target_pool, draft_pool, block_source, EngineConfig(...))
    engine.add_request(RequestSpec(request_id, prompt_ids, block_table, reused_positions,
                                   max_new_tokens, stop_ids, sampling=SamplingParams(...), k))
    engine.step() -> StepReport          # per request: RequestStepResult
    engine.abort(request_id); engine.has_work()

    BlockSource (protocol: extend / trim), LocalBlockSource (in-process allocator)
    services.gpuworker.engine.local: build_local / submit / run_until_done / generate

Modules: ``sampling`` (transform + seeded draws), ``acceptance`` (greedy / rejection / forced
verification), ``request`` (spec + state), ``scheduler`` (token budget), ``drafting`` (fill and
chain of the draft layers), ``capacity`` (BlockSource), ``report`` (step results), ``graphs``
(padded / captured forwards), ``spec_step`` (a greedy speculative step as one forward),
``fused`` (the engine's fused, continued steps), ``readback`` (device results on their way to
the host), ``engine``.
"""

from services.gpuworker.engine.capacity import BlockSource, LocalBlockSource
from services.gpuworker.engine.engine import Engine, EngineConfig
from services.gpuworker.engine.report import RequestStepResult, StepReport
from services.gpuworker.engine.request import FinishReason, RequestSpec
from services.gpuworker.engine.sampling import GREEDY, SamplingParams

__all__ = [
    "BlockSource",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "GREEDY",
    "LocalBlockSource",
    "RequestSpec",
    "RequestStepResult",
    "SamplingParams",
    "StepReport",
]
