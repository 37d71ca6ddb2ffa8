"""CUDA graphs for the uniform forwards of a step: plain decode, verify, draft chain and the
EAGLE-3 draft fill after a verify (its rows padded per request, see ``DraftRunner._split_fill``).

A decode step of B requests that each feed the same number q of tokens (q = 1: plain decode or a
draft-chain position; q = k + 1: verify) has a fixed shape once B is rounded up to a *bucket*
(1, 2, 4, 8, 16, 24, 32, 48, 64, ... as vLLM and SGLang do). The engine captures one graph per
(forward, attention kind, bucket, q) at start-up and afterwards only re-plans and replays:

    real batch (B = 3, q = 2)            padded to the bucket (4)
    request 0  table [7 2]  cached 20    request 0..2 as given
    request 1  table [5]    cached 9     request 3  table [S]  cached 0  query 2
    request 2  table [1 4]  cached 17      (S = the scratch page: one extra page of each pool
                                            that the kvstore never hands out; padding rows
                                            write their K/V there and nothing reads them)

    plan(padded layout)  ->  copy inputs into the static buffers  ->  replay  ->  rows [0, B*q)

Replay is correct after a re-plan because every tensor a captured forward reads lives at a
stable address per plan key: the attention backend keeps its metadata in per-key workspace
buffers (``graph_max_pages_per_request`` makes FlashInfer's wrappers graph-safe), and the inputs
live in the static buffers here. Outputs are views of the graph's own memory: valid until the
next replay of any graph (the engine reads them within the step).

A forward may also take or return one row per *request* (``register(per_request=...)``: the fill
reads the index of each request's last row and returns logits of those rows only); those are
padded to the bucket, not to bucket × q. Every graph of a forward reads its inputs from one
buffer of the largest shape, so a row past this run's ``B`` (or ``B * q``) holds whatever an
earlier run of ANOTHER (bucket, q) left there unless it is cleared: the padding rows of every
input are zero on every run, as eager padding makes them (``_stage``). A stale per-request index
there is an index into another shape's rows; the fill's ``last`` of a q = 4 run read by a q = 1
graph of the same bucket was a device-side assert (``index_select`` past ``bucket * q``).

A forward may also run over several plans (``register(lanes=...)``, ``run_lanes``): the whole
greedy speculative step of ``spec_step.py`` attends over the verify's layout and the k - 1 draft
chain positions' layouts, each planned on a lane of its own (its own workspace,
``AttentionBackend.plan(lane=)``), all before the one replay that reads them. A single-plan forward may be pinned to a lane of its
own instead (``register(lane=j)``): the split speculative step chains its positions through
forwards on lanes 1 .. k-1, each replayed right after its plan, while the previous one runs.

Without CUDA (or with capture off) the same padding runs eagerly, through the same static input
buffers, so the CPU tests exercise the exact layouts AND inputs a GPU replays. Its outputs keep
the replay's contract too: they are copied into buffers of the forward's own, and every padded
run first poisons every earlier output of every forward (NaN; a large negative number in integer
outputs), so a caller that keeps an output past the next run of any graph (it must copy what it
keeps) reads garbage on the CPU as well, instead of only on the GPU. Shapes without a captured
graph (ragged, prefill, a batch above the largest bucket, a q never captured) run eagerly and
unpadded.

Debugging: ``check_inputs`` (or ``TANDEM_CHECK_GRAPH_INPUTS=1`` in the environment) checks, before
every padded run or replay, that each input declared with ``register(bounds=...)`` lies in its
range over the whole padded batch, and raises ``InvalidArgument`` naming the forward, input and
row instead of a device-side assert. It reads the inputs back (one sync per input): off by
default.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from services.common.errors import InvalidArgument
from services.gpuworker.attention.base import MAX_LANES, AttentionBackend, AttentionKind, AttentionPlan, BatchLayout

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

# fn(plan, **inputs) -> named outputs; every input and output has one row per token
Forward = Callable[..., dict[str, torch.Tensor]]
# (padded batch, q) -> exclusive upper bound of an input's values (a vocabulary, a row count)
Bound = Callable[[int, int], int]

CHECK_INPUTS_ENV = "TANDEM_CHECK_GRAPH_INPUTS"


def buckets_up_to(max_batch: int) -> tuple[int, ...]:
    """The default buckets that a batch of at most ``max_batch`` requests can need (the last
    bucket is ``max_batch`` itself when it falls between two defaults)."""
    if max_batch < 1:
        raise InvalidArgument(f"max_batch must be >= 1, got {max_batch}")
    out = [b for b in DEFAULT_BUCKETS if b < max_batch]
    return (*out, max_batch)


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


class ForwardGraphs:
    """Pads uniform batches to buckets and replays captured forwards. Mutates the KV pools (the
    forwards write K/V, padding rows into the scratch page) and its own static buffers.

    ``capture=False`` keeps the padding but runs every forward eagerly (CPU, ``--no-cuda-graphs``
    tests). Forwards are registered by name with :meth:`register`; :meth:`capture_all` captures
    every registered (name, kind, bucket, q) once, at start-up.
    """

    def __init__(
        self,
        backend: AttentionBackend,
        *,
        scratch_block: int,
        buckets: Sequence[int],
        capture: bool,
        check_inputs: bool | None = None,
    ):
        if capture and backend.device.type != "cuda":
            raise InvalidArgument(f"CUDA graphs need a CUDA device, the backend is on {backend.device}")
        safe = set(getattr(backend, "graph_safe_kinds", ()))
        if capture and not {AttentionKind.DECODE, AttentionKind.VERIFY} <= safe:
            raise InvalidArgument(
                f"the {backend.name} attention backend cannot replay decode/verify plans in CUDA graphs "
                "(use flashinfer with graph_max_pages_per_request, or no graphs)"
            )
        if list(buckets) != sorted(set(buckets)) or not buckets or buckets[0] < 1:
            raise InvalidArgument(f"buckets must be increasing positive integers, got {list(buckets)}")
        self.backend = backend
        self.scratch_block = scratch_block
        self.buckets = tuple(buckets)
        self.capture = capture
        self._forwards: dict[str, tuple[Forward, dict[str, tuple[tuple[int, ...], torch.dtype]], tuple[int, ...]]] = {}
        self._per_request: dict[str, frozenset[str]] = {}  # forward -> inputs/outputs with a row per request
        self._lanes: dict[str, Callable[[int], Sequence[int]] | None] = {}  # forward -> its plans' query lengths
        self._lane: dict[str, int] = {}  # single-plan forward -> the lane its plans are made on
        # forward -> input name -> one buffer for its largest shape; every graph of the forward
        # reads a leading slice of it (inputs are copied in just before a replay, and only one
        # graph replays at a time): the fill's [rows, 3H] inputs for every (bucket, q) would
        # otherwise take hundreds of MB on an 8B model
        self._input_buffers: dict[str, dict[str, torch.Tensor]] = {}
        # forward -> input name -> rows of its shared buffer that may be non-zero (past them: zero)
        self._dirty: dict[str, dict[str, int]] = {}
        self._bounds: dict[str, dict[str, Bound]] = {}
        # debugging (module docstring): range-check bounded inputs before every run
        self.check_inputs = os.environ.get(CHECK_INPUTS_ENV) == "1" if check_inputs is None else bool(check_inputs)
        self._graphs: dict[tuple, _Captured] = {}
        # forward -> output name -> the buffer an eager padded run's output is copied into,
        # poisoned by the next padded run (the replay's contract, see the module docstring)
        self._eager_outputs: dict[str, dict[str, torch.Tensor]] = {}
        self._pool = None  # one memory pool shared by every graph (only one replays at a time)
        self.replays = 0
        self.eager_runs = 0

    # -- set-up ------------------------------------------------------------------------------------

    def register(
        self,
        name: str,
        fn: Forward,
        inputs: dict[str, tuple[tuple[int, ...], torch.dtype]],
        query_lens: Iterable[int],
        per_request: Iterable[str] = (),
        bounds: dict[str, int | Bound] | None = None,
        lanes: Callable[[int], Sequence[int]] | None = None,
        lane: int = 0,
    ) -> None:
        """Declare a forward: its input row shapes (without the token dimension) and dtypes, and
        the query lengths to capture it for. Inputs and outputs named in ``per_request`` have
        one row per request instead of one per token (a row index per request, say).
        ``bounds``: input -> exclusive upper bound of its values (an int, or ``fn(padded batch,
        q)``), lower bound 0; checked only with ``check_inputs``.

        ``lanes``: a forward over SEVERAL plans made before its one launch (``run_lanes``):
        ``lanes(q)`` gives the query length of each plan for the graph keyed ``q``, and the
        forward is called as ``fn(plans, **inputs)`` with plan ``i`` made on lane ``i`` (its own
        workspace, ``AttentionBackend.plan``). Without it, ``fn(plan, **inputs)`` with the plan
        made on ``lane``: forwards planned one after another within a step (the split
        speculative step's chain positions) each keep a workspace of their own, so a plan never
        waits for the previous plan of its key (FlashInfer's pinned staging) and each graph
        reads its own buffers. Forwards on one lane share its workspaces (each replay follows
        its own plan)."""
        qs = tuple(sorted(set(query_lens)))
        if (not isinstance(lane, int) or isinstance(lane, bool) or not 0 <= lane < MAX_LANES
                or (lanes is not None and lane)):
            raise InvalidArgument(f"{name}: lane must be an integer in [0, {MAX_LANES}) (0 with lanes=), got {lane!r}")
        bs = self.backend.geometry.block_size
        if lanes is not None:
            bad = [q for q in qs if not lanes(q) or any(lq < 1 or lq > bs for lq in lanes(q))]
            if bad:
                raise InvalidArgument(f"{name}: lane query lengths must be in 1..block_size ({bs}) for q {bad}")
        elif any(q < 1 or q > bs for q in qs):
            raise InvalidArgument(f"captured query lengths must be in 1..block_size ({bs}), got {qs}")
        unknown = set(bounds or ()) - set(inputs)
        if unknown:
            raise InvalidArgument(f"{name}: bounds for inputs it does not take: {sorted(unknown)}")
        self._forwards[name] = (fn, inputs, qs)
        self._lanes[name] = lanes
        self._lane[name] = lane
        self._per_request[name] = frozenset(per_request)
        self._bounds[name] = {k: (b if callable(b) else (lambda _b, _q, n=int(b): n)) for k, b in (bounds or {}).items()}

    def capture_all(self, progress: Callable[[str], None] | None = None) -> int:
        """Capture every registered forward for every bucket (largest first, so the shared pool is
        sized once). Returns the number of graphs; a no-op without ``capture``."""
        if not self.capture:
            return 0
        t0 = time.perf_counter()
        for name, (fn, specs, qs) in self._forwards.items():
            for q in qs:
                for b in sorted(self.buckets, reverse=True):
                    self._capture(name, fn, specs, b, q)
            if progress is not None:
                progress(f"captured {name}: {len(qs)} query length(s) x {len(self.buckets)} buckets "
                         f"({time.perf_counter() - t0:.1f}s)")
        return len(self._graphs)

    @staticmethod
    def _kind(q: int) -> AttentionKind:
        return AttentionKind.DECODE if q == 1 else AttentionKind.VERIFY

    def _scratch_layout(self, batch: int, q: int) -> BatchLayout:
        return BatchLayout(block_tables=[[self.scratch_block]] * batch, cached_lens=[0] * batch, query_lens=[q] * batch)

    def _shared_inputs(self, name: str) -> dict[str, torch.Tensor]:
        """The forward's input buffers (largest shape, zero-filled), made on first use."""
        shared = self._input_buffers.get(name)
        if shared is None:
            _fn, specs, qs = self._forwards[name]
            per_request = self._per_request[name]
            top, top_q = self.buckets[-1], max(qs)
            shared = self._input_buffers[name] = {
                k: torch.zeros((top if k in per_request else top * top_q, *shape), dtype=dtype, device=self.backend.device)
                for k, (shape, dtype) in specs.items()}
            self._dirty[name] = {k: 0 for k in specs}
        return shared

    def _capture(self, name, fn, specs, batch: int, q: int) -> None:
        per_request = self._per_request[name]
        dev = self.backend.device
        shared = self._shared_inputs(name)
        inputs = {k: shared[k][: batch if k in per_request else batch * q] for k in specs}
        lanes = self._lanes[name]
        if lanes is None:
            plan = self.backend.plan(self._scratch_layout(batch, q), self._kind(q), lane=self._lane[name])
        else:
            qs = tuple(lanes(q))
            plan = self._plan_lanes([self._scratch_layout(batch, lq) for lq in qs], qs)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up run: lazy inits must not happen under capture
            fn(plan, **inputs)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = fn(plan, **inputs)
        self._graphs[(name, batch, q)] = _Captured(graph, inputs, outputs)

    # -- running -----------------------------------------------------------------------------------

    @property
    def captured(self) -> int:
        """How many graphs have been captured."""
        return len(self._graphs)

    def bucket(self, batch: int) -> int | None:
        """Smallest bucket holding ``batch`` requests, or None when the batch is too large."""
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def covers(self, name: str, batch: int, q: int) -> bool:
        """Whether ``run`` pads (and, with capture, replays) this shape."""
        entry = self._forwards.get(name)
        return entry is not None and q in entry[2] and self.bucket(batch) is not None

    def run(self, name: str, layout: BatchLayout, inputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], AttentionPlan]:
        """Run forward ``name`` over ``layout`` (uniform query length q, covered shape). Returns
        the outputs' first ``B * q`` rows (``B`` for per-request outputs) and the plan of the
        padded layout. Mutates the forward's shared input buffers (``_stage``)."""
        q = layout.arrays.uniform_q
        batch = layout.batch_size
        padded_batch = self.bucket(batch)
        if self._lanes.get(name) is not None:
            raise InvalidArgument(f"{name} runs over several plans: use run_lanes")
        if q is None or padded_batch is None or not self.covers(name, batch, q):
            raise InvalidArgument(f"{name}: shape (batch {batch}, q {q}) is not covered by the graphs")
        plan = self.backend.plan(self._pad(layout, padded_batch, q), self._kind(q), lane=self._lane[name])
        return self._execute(name, plan, inputs, batch, padded_batch, q), plan

    def run_lanes(self, name: str, q: int, layouts: Sequence[BatchLayout], inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the several-plan forward ``name`` (``register(lanes=...)``) keyed ``q``: layout
        ``i`` (uniform query length ``lanes(q)[i]``, the same batch size for all) is padded and
        planned on lane ``i``; then one replay. Returns the outputs as ``run`` does. Mutates
        the forward's input buffers and the lanes' workspaces."""
        lanes = self._lanes.get(name)
        if lanes is None:
            raise InvalidArgument(f"{name} is not a several-plan forward")
        batch = layouts[0].batch_size if layouts else 0
        padded_batch = self.bucket(batch)
        want = tuple(lanes(q)) if q in self._forwards[name][2] else None
        got = tuple(layout.arrays.uniform_q for layout in layouts)
        if want is None or padded_batch is None or not batch or got != want or any(
                layout.batch_size != batch for layout in layouts):
            raise InvalidArgument(f"{name}: layouts (batch {batch}, query lengths {got}) are not covered "
                                  f"by the graphs keyed q {q} (query lengths {want})")
        plans = self._plan_lanes([self._pad(layout, padded_batch, lq) for layout, lq in zip(layouts, want)], want)
        return self._execute(name, plans, inputs, batch, padded_batch, q)

    def _plan_lanes(self, layouts: Sequence[BatchLayout], qs: Sequence[int]) -> tuple[AttentionPlan, ...]:
        """Plan ``layouts[i]`` (query length ``qs[i]``) on lane ``i``: plans that live together."""
        return tuple(self.backend.plan(layout, self._kind(lq), lane=i) for i, (layout, lq) in enumerate(zip(layouts, qs)))

    def _execute(self, name: str, plan, inputs: dict[str, torch.Tensor], batch: int, padded_batch: int,
                 q: int) -> dict[str, torch.Tensor]:
        """Stage ``inputs`` and replay the captured graph (or run the forward eagerly over the same
        buffers); the outputs' real rows."""
        fn = self._forwards[name][0]
        per_request = self._per_request[name]

        def rows(k: str, n: int) -> int:  # rows of input/output k for n requests
            return n if k in per_request else n * q

        staged = self._stage(name, inputs, batch, padded_batch, q)
        if self.check_inputs:
            self._check_ranges(name, staged, padded_batch, q)
        captured = self._graphs.get((name, padded_batch, q))
        if captured is None:  # padding without a graph: the same layouts and inputs, run eagerly
            self.eager_runs += 1
            self._poison_outputs()
            out = fn(plan, **staged)
            return {k: self._reused(name, k, v)[: rows(k, batch)] for k, v in out.items()}
        captured.graph.replay()
        self.replays += 1
        return {k: v[: rows(k, batch)] for k, v in captured.outputs.items()}

    def _poison_outputs(self) -> None:
        """Overwrite every output an earlier padded run returned: from here on they are invalid,
        as a replay's are after the next replay of any graph. Mutates the output buffers."""
        for buffers in self._eager_outputs.values():
            for buf in buffers.values():
                buf.fill_(float("nan") if buf.is_floating_point() else -(1 << 30))

    def _reused(self, name: str, key: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` copied into the forward's buffer for output ``key`` (grown to fit), which
        the next padded run poisons. Mutates that buffer."""
        buffers = self._eager_outputs.setdefault(name, {})
        buf = buffers.get(key)
        if buf is None or buf.shape[1:] != value.shape[1:] or buf.dtype != value.dtype or buf.shape[0] < value.shape[0]:
            buf = buffers[key] = torch.empty_like(value)
        view = buf[: value.shape[0]]
        view.copy_(value)
        return view

    def _stage(self, name: str, inputs: dict[str, torch.Tensor], batch: int, padded_batch: int, q: int) -> dict[str, torch.Tensor]:
        """Copy ``inputs`` into the forward's shared buffers (what a captured graph reads) and
        return the padded views: rows past the real ones are zero, as eager padding makes them.
        Mutates the shared buffers. Zeroes only rows that an earlier, larger run wrote (the
        buffers start zero), so a steady batch pays one copy per input and nothing else."""
        shared = self._shared_inputs(name)
        dirty = self._dirty[name]
        per_request = self._per_request[name]
        unknown = inputs.keys() - shared.keys()  # a name the forward never reads
        if unknown:
            raise InvalidArgument(f"{name}: inputs it does not take: {sorted(unknown)}")
        views = {}
        for k, buf in shared.items():
            unit = 1 if k in per_request else q
            n, full = batch * unit, padded_batch * unit
            v = inputs.get(k)
            if v is None:
                raise InvalidArgument(f"{name}: input {k!r} missing")
            if v.shape[0] != n or tuple(v.shape[1:]) != tuple(buf.shape[1:]):
                raise InvalidArgument(
                    f"{name}: input {k!r} has shape {tuple(v.shape)}, expected ({n}, *{tuple(buf.shape[1:])})")
            buf[:n].copy_(v)
            if dirty[k] > n:
                buf[n : dirty[k]].zero_()
            dirty[k] = n
            views[k] = buf[:full]
        return views

    def _check_ranges(self, name: str, staged: dict[str, torch.Tensor], padded_batch: int, q: int) -> None:
        """Debugging (``check_inputs``): every bounded input over the whole padded batch lies in
        ``[0, bound)``; ``InvalidArgument`` naming the first bad row otherwise. Syncs."""
        for k, bound_of in self._bounds[name].items():
            t = staged[k]
            bound = int(bound_of(padded_batch, q))
            bad = ((t < 0) | (t >= bound)).reshape(t.shape[0], -1).any(dim=1).nonzero()
            if bad.numel():
                row = int(bad[0, 0])
                raise InvalidArgument(
                    f"{name} (bucket {padded_batch}, q {q}): input {k!r} row {row} holds "
                    f"{t[row].tolist()}, outside [0, {bound}) ({bad.numel()} bad row(s))")

    def _pad(self, layout: BatchLayout, padded_batch: int, q: int) -> BatchLayout:
        extra = padded_batch - layout.batch_size
        return layout.padded(extra, self.scratch_block, q) if extra else layout

