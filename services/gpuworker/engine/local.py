"""The engine in-process, without a kvstore: a ``LocalBlockSource``, a model, the torch backend.

For demos, tests and ``distill-draft``'s acceptance measurement::

    setup = build_local("tiny", spec_mode=SpecMode.EAGLE3)
    submit(setup, "a", prompt_ids, max_new_tokens=32, k=4)
    done = run_until_done(setup)          # {"a": Completion(tokens=[...], ...)}

``run_until_done`` plays the worker service's part: it steps the engine, collects tokens, and
releases each finished request's reservation (unless asked to keep it, e.g. to let a later request
reuse its published prefix blocks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from services.common.spec import SpecMode
from services.gpuworker.attention.base import get_backend
from services.gpuworker.engine.capacity import LocalBlockSource
from services.gpuworker.engine.engine import Engine, EngineConfig
from services.gpuworker.engine.report import StepReport
from services.gpuworker.engine.request import DecodeCounts, FinishReason, RequestSpec
from services.gpuworker.engine.sampling import GREEDY, SamplingParams, TokenLogprob
from services.gpuworker.model.draft import DraftModel
from services.gpuworker.model.llama import TargetModel


@dataclasses.dataclass
class LocalSetup:
    """An engine and the pieces it was built from (all mutable, owned by the caller)."""

    engine: Engine
    source: LocalBlockSource
    target: TargetModel
    draft: DraftModel | None


@dataclasses.dataclass
class Completion:
    """A finished request as ``run_until_done`` saw it."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    counts: DecodeCounts = DecodeCounts()  # the engine's totals, as of the last result
    publishable_positions: int = 0
    block_table: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # when asked for

    @property
    def decode_steps(self) -> int:
        return self.counts.decode_steps

    @property
    def proposed_drafts(self) -> int:
        return self.counts.proposed_drafts

    @property
    def accepted_drafts(self) -> int:
        return self.counts.accepted_drafts

    @property
    def acceptance_length(self) -> float:
        return self.counts.acceptance_length


def build_local(
    model: str = "tiny",
    *,
    spec_mode: SpecMode = SpecMode.NONE,
    mtp_depth: int = 1,
    num_blocks: int = 256,
    block_size: int = 16,
    config: EngineConfig = EngineConfig(),
    device: str = "cpu",
    seed: int = 0,
    models: tuple[TargetModel, DraftModel | None] | None = None,
) -> LocalSetup:
    """Build a local engine. ``models`` reuses already loaded (target, draft) instead of loading
    ``model``; fresh, zeroed KV pools are always allocated."""
    if models is None:
        from services.gpuworker.model.loader import load_model

        target, draft, _ = load_model(model, spec_mode=spec_mode, mtp_depth=mtp_depth, device=device, seed=seed)
    else:
        target, draft = models
    backend = get_backend("torch", device, target.attention_geometry(block_size))
    pages = num_blocks + (1 if config.graphs != "off" else 0)  # + the graphs' scratch page
    target_pool = target.new_kv_pool(pages, block_size)
    draft_pool = draft.new_kv_pool(pages, block_size) if draft is not None else None
    source = LocalBlockSource(num_blocks, block_size)
    engine = Engine(target, draft, backend, target_pool, draft_pool, source, config)
    return LocalSetup(engine, source, target, draft)


def submit(
    setup: LocalSetup,
    request_id: str,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int = 16,
    k: int = 0,
    sampling: SamplingParams = GREEDY,
    stop_ids: Sequence[int] = (),
    prefix_blocks: Sequence[int] = (),
    reused_positions: int = 0,
    headroom: int = 0,
    logprobs: int | None = None,
) -> None:
    """Reserve blocks for the prompt (+ ``headroom`` positions), sharing ``prefix_blocks`` whose
    first ``reused_positions`` positions hold valid KV, and admit the request. Mutates."""
    table = setup.source.reserve(request_id, len(prompt_ids) + headroom, prefix_blocks)
    try:
        setup.engine.add_request(RequestSpec(
            request_id=request_id, prompt_ids=list(prompt_ids), block_table=table,
            reused_positions=reused_positions, max_new_tokens=max_new_tokens, stop_ids=tuple(stop_ids),
            sampling=sampling, k=k, logprobs=logprobs,
        ))
    except Exception:
        setup.source.release(request_id)
        raise


def run_until_done(
    setup: LocalSetup,
    *,
    keep: Sequence[str] = (),
    on_step: Callable[[StepReport], None] | None = None,
    max_steps: int = 100_000,
) -> dict[str, Completion]:
    """Step until no request is left; release finished reservations except those in ``keep``.
    ``on_step`` sees every report. Returns request id → ``Completion``. Mutates everything."""
    done: dict[str, Completion] = {}
    for _ in range(max_steps):
        if not setup.engine.has_work():
            return done
        report = setup.engine.step()
        if on_step is not None:
            on_step(report)
        for rid, r in report.results.items():
            c = done.setdefault(rid, Completion())
            c.tokens.extend(r.new_token_ids)
            if r.new_logprobs:
                c.logprobs.extend(r.new_logprobs)
            c.counts = r.counts
            c.publishable_positions = r.publishable_positions
            c.block_table = list(r.block_table)
            if r.finished:
                c.finish_reason = r.finish_reason
                if rid not in keep:
                    setup.source.release(rid)
    raise RuntimeError(f"requests still running after {max_steps} steps")


@torch.inference_mode()
def generate(
    setup: LocalSetup, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 16, k: int = 0,
    sampling: SamplingParams = GREEDY,
) -> list[Completion]:
    """Convenience: run ``prompts`` as one continuous batch and return their completions in order."""
    for i, p in enumerate(prompts):
        submit(setup, f"gen-{i}", p, max_new_tokens=max_new_tokens, k=k, sampling=sampling)
    done = run_until_done(setup)
    return [done[f"gen-{i}"] for i in range(len(prompts))]
