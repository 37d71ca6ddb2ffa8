"""``tandem distill-draft``: train the draft layers on the target's own greedy continuations.

    random byte prompts ──engine, plain greedy──▶ sequences t[0..N)
    target forward (frozen) ──▶ hidden h, aux a, labels y[i] = argmax target logits at i
    draft (trained, same paged forward the engine runs):
      EAGLE-3  position i reads t[i+1] and a[i], learns y[i+1] (= the token after t[i+1]);
               plus one self-fed pass (context g[i-1] instead of a[i]) for chained proposals
      MTP      module k at position i reads t[i+k] and m_(k-1)[i], learns y[i+k]
    ──▶ save next to the model ──▶ acceptance length before / after, measured by the engine

The labels are the target's own predictions, so the draft learns what the target *will* say, not
what a corpus says. CPU-friendly: the tiny model trains in about a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from services.common.errors import InvalidArgument
from services.common.paths import distilled_tiny_dir
from services.common.spec import SpecMode
from services.gpuworker.attention.base import BatchLayout, get_backend
from services.gpuworker.engine.capacity import blocks_for
from services.gpuworker.engine.local import build_local, generate
from services.gpuworker.model.draft import DraftModel
from services.gpuworker.model.llama import TargetModel
from services.gpuworker.model.loader import load_model, save_draft, save_model

BLOCK_SIZE = 16


@dataclasses.dataclass
class DistillResult:
    """What a distillation run did (acceptance length = mean tokens per verify step)."""

    out_dir: str
    spec_mode: str
    steps: int
    loss_first: float  # mean training loss over the first 10 % of steps
    loss_last: float  # ... and over the last 10 %
    acceptance_before: float
    acceptance_after: float


def distill_draft(
    model_dir_or_tiny: str,
    out_dir: str | None = None,
    steps: int = 300,
    *,
    spec_mode: SpecMode = SpecMode.EAGLE3,
    mtp_depth: int = 1,
    num_sequences: int = 256,
    prompt_len: int = 16,
    gen_len: int = 48,
    batch_size: int = 8,
    lr: float = 5e-3,
    k: int = 4,
    eval_prompts: int = 8,
    seed: int = 0,
    progress: bool = True,
) -> DistillResult:
    """Train the ``spec_mode`` draft of a model and save it (mutates ``out_dir`` on disk).

    ``out_dir`` defaults to the model folder; the built-in ``tiny`` model has none, so its whole
    folder (target + trained draft + tokenizer marker) is written to ``out_dir``, loadable with
    ``load_model(out_dir, spec_mode=...)``. Raises ``InvalidArgument`` for bad arguments."""
    if spec_mode not in (SpecMode.EAGLE3, SpecMode.MTP):
        raise InvalidArgument("distill-draft trains EAGLE3 or MTP drafts")
    for name, v in (("steps", steps), ("num_sequences", num_sequences), ("prompt_len", prompt_len),
                    ("gen_len", gen_len), ("batch_size", batch_size), ("eval_prompts", eval_prompts)):
        if not isinstance(v, int) or v < 1:
            raise InvalidArgument(f"{name} must be a positive integer, got {v!r}")
    if str(model_dir_or_tiny) == "tiny" and out_dir is None:
        raise InvalidArgument("the built-in tiny model has no folder: give out_dir")
    target, draft, tokenizer = load_model(model_dir_or_tiny, spec_mode=spec_mode, mtp_depth=mtp_depth, seed=seed)
    target.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)

    train_prompts = _byte_prompts(num_sequences, prompt_len, gen)
    eval_set = evaluation_prompts(eval_prompts, prompt_len, seed)
    before = measure_acceptance(target, draft, eval_set, k=k, max_new_tokens=gen_len)
    if spec_mode is SpecMode.EAGLE3 and not _has_trained_draft(model_dir_or_tiny, spec_mode):
        # start from the target's vocabulary projection: the draft then only has to learn the
        # shift by one token, not the whole output embedding
        with torch.no_grad():
            draft.lm_head.weight.copy_(target.lm_head.weight)
    plain = build_local(models=(target, None), num_blocks=num_sequences * blocks_for(prompt_len + gen_len, BLOCK_SIZE),
                        block_size=BLOCK_SIZE)
    sequences = [p + c.tokens for p, c in zip(train_prompts, generate(plain, train_prompts, max_new_tokens=gen_len))]
    data = _TargetData(target, draft, sequences)

    draft.train()
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    losses = []
    bar = tqdm(range(steps), desc=f"distill {spec_mode.name.lower()}", disable=not progress)
    for _ in bar:
        idx = torch.randint(0, len(sequences), (batch_size,), generator=gen).tolist()
        loss = data.loss(idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    draft.eval()

    if str(model_dir_or_tiny) == "tiny":
        folder = save_model(target, out_dir, draft=draft, tokenizer=tokenizer)
    else:
        folder = Path(out_dir or model_dir_or_tiny)
        save_draft(draft, folder)
    after = measure_acceptance(target, draft, eval_set, k=k, max_new_tokens=gen_len)
    edge = max(1, steps // 10)  # single-batch losses are noisy: report means of the first/last 10 %
    return DistillResult(str(folder), spec_mode.name, steps, sum(losses[:edge]) / edge, sum(losses[-edge:]) / edge,
                         before, after)


def measure_acceptance(target: TargetModel, draft: DraftModel, prompts: list[list[int]], *, k: int = 4,
                       max_new_tokens: int = 48) -> float:
    """Mean tokens per verify step of greedy speculative decoding with the engine (pure apart
    from scratch pools it allocates)."""
    n = max(len(p) for p in prompts) + max_new_tokens
    setup = build_local(models=(target, draft), block_size=BLOCK_SIZE,
                        num_blocks=len(prompts) * blocks_for(n + k + 1, BLOCK_SIZE))
    done = generate(setup, prompts, max_new_tokens=max_new_tokens, k=k)
    steps = sum(c.decode_steps for c in done)
    return (steps + sum(c.accepted_drafts for c in done)) / max(steps, 1)


def _has_trained_draft(model: str, spec_mode: SpecMode) -> bool:
    """Whether the model folder already holds draft weights of this mode (then train on from them)."""
    meta = Path(model) / "tandem_draft.json"
    if str(model) == "tiny" or not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text(encoding="utf-8")).get("draft", {}).get("spec_mode") == spec_mode.name
    except (OSError, ValueError):
        return False


def evaluation_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """The held-out prompts acceptance is measured on (their own seed: never trained on)."""
    return _byte_prompts(n, length, torch.Generator().manual_seed(seed + 1_000_003))


def _byte_prompts(n: int, length: int, gen: torch.Generator) -> list[list[int]]:
    return torch.randint(0, 256, (n, length), generator=gen).tolist()


class _TargetData:
    """Frozen target outputs for the training sequences, and the draft's loss on a batch of them."""

    def __init__(self, target: TargetModel, draft: DraftModel, sequences: list[list[int]]):
        self.draft = draft
        self.n = min(len(s) for s in sequences)
        self.tokens = torch.tensor([s[: self.n] for s in sequences])
        self.backend = get_backend("torch", "cpu", target.attention_geometry(BLOCK_SIZE))
        per = blocks_for(self.n, BLOCK_SIZE)
        aux = draft.aux_layers if draft.spec_mode is SpecMode.EAGLE3 else ()
        hidden, labels = [], []
        chunk = 16  # sequences per forward: bounded memory for big models
        with torch.inference_mode():
            for start in range(0, len(self.tokens), chunk):
                batch = self.tokens[start : start + chunk]
                b = batch.shape[0]
                pool = target.new_kv_pool(b * per, BLOCK_SIZE)
                tables = [list(range(r * per, (r + 1) * per)) for r in range(b)]
                plan = self.backend.plan(BatchLayout(tables, [0] * b, [self.n] * b))
                out = target(batch.reshape(-1), plan, self.backend, pool, aux_layers=aux)
                hidden.append((out.aux_hidden if aux else out.hidden).view(b, self.n, -1).clone())
                labels.append(out.logits.argmax(-1).view(b, self.n))
        self.hidden = torch.cat(hidden)  # [S, n, C]
        self.labels = torch.cat(labels)  # [S, n]: target's prediction for the token after i

    def loss(self, idx: list[int]) -> torch.Tensor:
        """Mean cross-entropy of the draft over a batch of sequences (builds a graph)."""
        d, b = self.draft, len(idx)
        toks, hid, lab = self.tokens[idx], self.hidden[idx], self.labels[idx]
        span = d.span
        m = self.n - span - 1  # positions i whose label y[i+span] exists
        per = blocks_for(m, BLOCK_SIZE)
        pool = d.new_kv_pool(b * per, BLOCK_SIZE)
        plan = self.backend.plan(BatchLayout([list(range(r * per, (r + 1) * per)) for r in range(b)], [0] * b, [m] * b))
        if d.spec_mode is SpecMode.EAGLE3:
            nxt = toks[:, 1 : m + 1].reshape(-1)
            out = d(nxt, hid[:, :m].reshape(b * m, -1), plan, self.backend, pool, context_is_aux=True)
            target = lab[:, 1 : m + 1].reshape(-1)
            loss = F.cross_entropy(out.logits, target)
            # self-fed pass: position i reads g[i-1] (its own previous output) as chained drafting does
            g = out.hidden.view(b, m, -1)
            shifted = torch.cat([g[:, :1], g[:, :-1]], dim=1).reshape(b * m, -1)
            pool2 = d.new_kv_pool(b * per, BLOCK_SIZE)
            out2 = d(nxt, shifted, plan, self.backend, pool2, context_is_aux=False)
            return loss + 0.5 * F.cross_entropy(out2.logits, target)
        prev = hid[:, :m].reshape(b * m, -1)
        total = 0.0
        for k in range(1, d.num_kv_layers + 1):
            out = d(k, toks[:, k : m + k].reshape(-1), prev, plan, self.backend, pool)
            total = total + F.cross_entropy(out.logits, lab[:, k : m + k].reshape(-1))
            prev = out.hidden
        return total / d.num_kv_layers


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Flags of ``tandem distill-draft``."""
    ap.add_argument("model", help='model folder, or "tiny" for the built-in model')
    ap.add_argument("--out", default=None,
                    help=f"output folder (default: the model folder; for tiny: {distilled_tiny_dir()}, which `tandem up` serves)")
    ap.add_argument("--mode", choices=["eagle3", "mtp"], default="eagle3")
    ap.add_argument("--mtp-depth", type=int, default=1)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step when measuring acceptance")
    ap.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    """Train, save, print acceptance before/after as JSON. Exit 2 on bad arguments."""
    out = args.out
    if out is None and str(args.model) == "tiny":
        out = str(distilled_tiny_dir(args.mode))
    try:
        result = distill_draft(
            args.model, out, args.steps, spec_mode=SpecMode[args.mode.upper()], mtp_depth=args.mtp_depth,
            num_sequences=args.sequences, gen_len=args.gen_len, batch_size=args.batch_size, lr=args.lr,
            k=args.k, seed=args.seed,
        )
    except InvalidArgument as exc:
        print(f"distill-draft: {exc.message}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(result), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI: ``distill-draft MODEL [--out DIR] [--mode eagle3|mtp] [--steps N] ...``; prints JSON."""
    ap = argparse.ArgumentParser(prog="tandem distill-draft", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
