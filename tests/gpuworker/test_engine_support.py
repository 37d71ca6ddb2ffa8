"""Helpers for the engine tests (this module holds no tests of its own).

* ``models(mode, depth)``: the tiny target + draft, loaded once per process.
* ``ScriptedDraft``: wraps a real draft — it still runs and writes the same draft KV — but
  replaces its logits with a script: the row at position i of draft layer k proposes the token
  the target will really produce at position ``i + k + 1`` (known from a plain greedy run), except
  at a deterministic ~25 % of (request, position, layer) where it proposes a wrong one. Random
  tiny drafts almost never agree with the target, so without this the accept path would go
  untested; and a misaligned engine (wrong position / token / hidden fed to a layer) makes the
  script's proposals wrong, so high acceptance proves the alignment.
* ``checked_plans(setup)``: wraps the backend's ``plan`` so every table the engine attends with is
  checked against the block source (exactly a live reservation's table, kv_len within capacity).
* ``reference_kv``: target and draft KV of a from-scratch, unchunked prefill of a token stream,
  computed straight through the model API (not through the engine).
"""

from __future__ import annotations

import functools
import zlib

import torch

from services.common.spec import SpecMode
from services.gpuworker.attention.base import BatchLayout, get_backend
from services.gpuworker.engine.capacity import blocks_for
from services.gpuworker.engine.engine import EngineConfig
from services.gpuworker.engine.local import LocalSetup, build_local, run_until_done, submit
from services.gpuworker.model.draft import DraftOutput

MODES = {"eagle3": (SpecMode.EAGLE3, 1), "mtp2": (SpecMode.MTP, 2), "mtp3": (SpecMode.MTP, 3)}


@functools.lru_cache(maxsize=None)
def models(mode: str):
    """(target, draft) of the tiny model for ``mode`` in MODES or "none". Read-only."""
    from services.gpuworker.model.loader import load_model

    spec, depth = MODES.get(mode, (SpecMode.NONE, 1))
    target, draft, _ = load_model("tiny", spec_mode=spec, mtp_depth=depth)
    return target, draft


def prompts(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


class ScriptedDraft(torch.nn.Module):
    """A draft whose proposals follow ``expected[request]`` (see the module docstring)."""

    def __init__(self, real, setup_ref: list, expected: dict[str, list[int]], miss_percent: int = 25):
        super().__init__()
        self.real = real
        self.setup_ref = setup_ref  # [LocalSetup], filled once the engine exists
        self.expected = expected
        self.miss_percent = miss_percent
        self.spec_mode, self.span = real.spec_mode, real.span
        self.num_kv_layers, self.aux_layers = real.num_kv_layers, real.aux_layers
        self.target_config = real.target_config
        self.chain_hidden_size = real.chain_hidden_size
        self.vocab = real.target_config.vocab_size

    def new_kv_pool(self, *a, **kw):
        return self.real.new_kv_pool(*a, **kw)

    def forward(self, *args, **kwargs):
        if self.spec_mode is SpecMode.MTP:
            layer, plan = args[0], args[3]
        else:
            layer, plan = 1, args[2]
        out = self.real(*args, **kwargs)
        rows = kwargs.get("logits_indices")
        rows = torch.arange(plan.num_tokens) if rows is None else rows
        source = self.setup_ref[0].source
        logits = torch.full((len(rows), self.vocab), -10.0)
        for j, r in enumerate(rows.tolist()):
            pos = int(plan.positions[r])
            table = list(plan.layout.block_tables[int(plan.batch_indices[r])])
            graphs = self.setup_ref[0].engine.graphs
            if graphs is not None and table == [graphs.scratch_block]:
                continue  # a padding row of a graph batch: its logits are never read
            if graphs is not None and len(table) > 1 and table[-1] == graphs.scratch_block:
                table = table[:-1]  # a capped fused row verifying past its capacity (Engine._launch_fused)
            rid = source.owner(table)
            seq = self.expected.get(rid, [])
            tok = seq[pos + layer + 1] if pos + layer + 1 < len(seq) else 0
            if zlib.crc32(f"{rid}:{pos}:{layer}".encode()) % 100 < self.miss_percent:
                tok = (tok + 1) % self.vocab
            logits[j, tok] = 10.0
        return DraftOutput(hidden=out.hidden, logits=logits)


def checked_plans(setup: LocalSetup) -> list[int]:
    """Check every planned table against the block source; returns a list that collects the
    largest kv_len of every plan (for max_seq_len assertions). Mutates ``setup.engine.backend``."""
    backend, source = setup.engine.backend, setup.source
    seen: list[int] = []
    original = backend.plan

    graphs = setup.engine.graphs
    scratch = [graphs.scratch_block] if graphs is not None else None

    def plan(layout, kind=None, lane=0):
        for table, kv_len in zip(layout.block_tables, layout.kv_lens):
            if list(table) == scratch:  # a padding row of a graph batch: the scratch page only
                assert kv_len <= setup.engine.block_size
                continue
            if scratch is not None and len(table) > 1 and table[-1] == scratch[0]:
                # a capped row of a fused step verifying past its capacity: the scratch page after its own
                source.owner(list(table[:-1]))
                assert kv_len <= len(table) * setup.engine.block_size
                continue
            source.owner(list(table), kv_len)
        seen.append(max(layout.kv_lens))
        return original(layout, kind, lane)

    backend.plan = plan
    return seen


def make_setup(mode: str, *, block_size=4, num_blocks=400, scripted: dict | None = None, miss_percent=25,
               **config) -> LocalSetup:
    """A local engine for ``mode``; with ``scripted`` (request id → expected tokens) the draft is a
    ``ScriptedDraft``. Every plan is checked against the block source."""
    target, draft = models(mode)
    ref: list = []
    if scripted is not None and draft is not None:
        draft = ScriptedDraft(draft, ref, scripted, miss_percent)
    setup = build_local(models=(target, draft), num_blocks=num_blocks, block_size=block_size,
                        config=EngineConfig(**config))
    ref.append(setup)
    checked_plans(setup)
    return setup


@functools.lru_cache(maxsize=None)
def _plain_greedy_cached(prompt: tuple, max_new: int) -> tuple:
    setup = make_setup("none", chunk_size=1024, max_batch_tokens=4096)
    submit(setup, "p", list(prompt), max_new_tokens=max_new)
    return tuple(run_until_done(setup)["p"].tokens)


def plain_greedy(prompt, max_new: int) -> list[int]:
    """Greedy output of the target alone (no draft, one unchunked prefill)."""
    return list(_plain_greedy_cached(tuple(prompt), max_new))


@torch.inference_mode()
def reference_kv(mode: str, tokens: list[int], block_size: int):
    """(target pool, draft pool, final draft positions) after a from-scratch unchunked prefill of
    ``tokens`` into blocks 0, 1, 2, ... Draft KV is final at positions < len(tokens) - D."""
    target, draft = models(mode)
    n = len(tokens)
    nb = blocks_for(n, block_size)
    backend = get_backend("torch", "cpu", target.attention_geometry(block_size))
    tp, dp = target.new_kv_pool(nb, block_size), draft.new_kv_pool(nb, block_size)
    table = list(range(nb))
    ids = torch.tensor(tokens)
    aux = draft.aux_layers if draft.spec_mode is SpecMode.EAGLE3 else ()
    out = target(ids, backend.plan(BatchLayout([table], [0], [n])), backend, tp, aux_layers=aux)
    m = n - draft.span
    plan = backend.plan(BatchLayout([table], [0], [m]))
    if draft.spec_mode is SpecMode.EAGLE3:
        draft(ids[1 : m + 1], out.aux_hidden[:m], plan, backend, dp, context_is_aux=True)
    else:
        prev = out.hidden[:m]
        for k in range(1, draft.num_kv_layers + 1):
            prev = draft(k, ids[k : k + m], prev, plan, backend, dp).hidden
    return tp, dp, m
