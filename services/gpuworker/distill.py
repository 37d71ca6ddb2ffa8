"""``tandem distill-draft``: train the draft layers on the target's own greedy continuations.

    prompts (--prompts FILE: plain text cut into windows, or JSONL: ShareGPT "conversations",
    chat "messages", "prompt" or "text" records; --dataset ORG/NAME: those files of a Hugging Face
    dataset repo; --stdlib: the Python standard library's sources; none: random bytes, for the
    byte-level tiny model) ── last ones held out ──▶
    prompts ──engine, plain greedy──▶ sequences t[0..N)
    target forward (frozen) ──▶ hidden h, aux a, labels y[i] = argmax target logits at i
    draft (trained, same paged forward the engine runs):
      EAGLE-3  position i reads t[i+1] and a[i], learns y[i+1] (= the token after t[i+1]);
               plus one self-fed pass (context g[i-1] instead of a[i]) for chained proposals
      MTP      module k at position i reads t[i+k] and m_(k-1)[i], learns y[i+k]
    ──▶ save next to the model ──▶ acceptance length before / after, measured by the engine

The labels are the target's own predictions, so the draft learns what the target *will* say, not
what a corpus says. Acceptance before and after is measured by the engine on held-out prompts
(never trained on). ``--draft-vocab N`` trains a reduced draft vocabulary: the N target ids the
target's continuations use most (``d2t``), as public EAGLE-3 heads do. Drafts are saved in the
public EAGLE-3 layout (``model/eagle3_format.py``). CPU-friendly: the tiny model trains in about a
minute.
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

from services.common.errors import InvalidArgument, NotFound
from services.common.paths import distilled_tiny_dir
from services.common.spec import SpecMode
from services.gpuworker.attention.base import BatchLayout, get_backend
from services.gpuworker.engine.capacity import blocks_for
from services.gpuworker.engine.local import build_local, generate
from services.gpuworker.model.draft import DraftModel, Eagle3Draft
from services.gpuworker.model.llama import TargetModel
from services.gpuworker.model.loader import load_draft, load_model, plan_model, save_draft, save_model

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
    prompts_file: str | None = None,
    stdlib: bool = False,
    dataset: str | None = None,
    dataset_revision: str | None = None,
    draft_model: str | None = None,
    draft_vocab: int = 0,
    save_dtype: torch.dtype | None = None,
) -> DistillResult:
    """Train the ``spec_mode`` draft of a model and save it (mutates ``out_dir`` on disk).

    ``out_dir`` defaults to the model folder (EAGLE-3: its ``eagle3/``); otherwise EAGLE-3 drafts
    go into ``out_dir`` itself (a folder for ``--draft-model``). The built-in ``tiny`` model has no
    folder, so its whole folder (target + trained draft + tokenizer marker) is written to
    ``out_dir``. ``draft_model`` starts from that draft (else: the model's own, else random).
    Raises ``InvalidArgument`` for bad arguments."""
    if spec_mode not in (SpecMode.EAGLE3, SpecMode.MTP):
        raise InvalidArgument("distill-draft trains EAGLE3 or MTP drafts")
    for name, v in (("steps", steps), ("num_sequences", num_sequences), ("prompt_len", prompt_len),
                    ("gen_len", gen_len), ("batch_size", batch_size), ("eval_prompts", eval_prompts)):
        if not isinstance(v, int) or v < 1:
            raise InvalidArgument(f"{name} must be a positive integer, got {v!r}")
    if draft_vocab and spec_mode is not SpecMode.EAGLE3:
        raise InvalidArgument("--draft-vocab applies to EAGLE-3 drafts")
    if sum(map(bool, (prompts_file, stdlib, dataset))) > 1:
        raise InvalidArgument("give one of --prompts, --dataset and --stdlib")
    if dataset_revision and not dataset:
        raise InvalidArgument("--dataset-revision applies to --dataset")
    texts = None
    if prompts_file:
        texts, source = read_prompts(prompts_file), prompts_file
    elif dataset:  # fetched before the model loads: a wrong id fails fast
        texts, source = dataset_prompts(dataset, dataset_revision), dataset
    builtin = str(model_dir_or_tiny) in ("tiny", "demo")
    if builtin and out_dir is None:
        raise InvalidArgument(f"the built-in {model_dir_or_tiny} model: give out_dir")
    start_from = draft_model
    if start_from is None:
        try:  # the model's own draft when it has one; random otherwise (what is trained here)
            plan_model(model_dir_or_tiny, spec_mode=spec_mode, mtp_depth=mtp_depth)
        except InvalidArgument:
            start_from = "random"
    target, draft, tokenizer = load_model(model_dir_or_tiny, spec_mode=spec_mode, mtp_depth=mtp_depth, seed=seed,
                                          draft_model=start_from)
    fresh = start_from == "random"
    target.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)

    train_prompts, eval_set = _prompts(tokenizer, texts, source if texts is not None else None, stdlib, num_sequences,
                                       eval_prompts, prompt_len, seed, gen)
    before = measure_acceptance(target, draft, eval_set, k=k, max_new_tokens=gen_len)
    sequences = _continuations(target, train_prompts, gen_len, progress)
    if draft_vocab:
        draft = _reduced_vocab_draft(target, draft, sequences, draft_vocab)
        fresh = True
    if spec_mode is SpecMode.EAGLE3 and fresh:
        # start from the target's vocabulary projection: the draft then only has to learn the
        # shift by one token, not the whole output embedding
        with torch.no_grad():
            draft.lm_head.weight.copy_(target.lm_head.weight[draft.d2t])
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
        folder = save_model(target, out_dir, draft=draft, tokenizer=tokenizer, dtype=save_dtype)
    elif out_dir is None:
        folder = save_draft(draft, model_dir_or_tiny, dtype=save_dtype)
    else:
        folder = save_draft(draft, out_dir, dtype=save_dtype, own_folder=True)
    # measured on exactly what was saved (read back as the engine will read it)
    draft = load_draft(target, folder if folder.is_dir() else folder.parent, spec_mode=spec_mode, mtp_depth=mtp_depth)
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


def evaluation_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """The held-out prompts acceptance is measured on (their own seed: never trained on)."""
    return _byte_prompts(n, length, torch.Generator().manual_seed(seed + 1_000_003))


def _byte_prompts(n: int, length: int, gen: torch.Generator) -> list[list[int]]:
    return torch.randint(0, 256, (n, length), generator=gen).tolist()


def _prompts(tokenizer, texts, source, stdlib, n_train, n_eval, length, seed, gen):
    """(training prompts, held-out prompts) as token ids of ``length`` tokens (prompts from
    ``texts`` may be shorter). Held-out prompts are never trained on: the stdlib's held-out files,
    or the last ``n_eval`` of ``texts`` (a file's or a dataset's prompts, named ``source``)."""
    if stdlib:
        from services.gpuworker.train_demo import split_corpus, corpus_bytes

        train_files, held_files = split_corpus()
        train = _windows(tokenizer, corpus_bytes(train_files), n_train, length, gen)
        held = _windows(tokenizer, corpus_bytes(held_files), n_eval, length, torch.Generator().manual_seed(seed + 7))
        return train, held
    if texts is not None:
        ids = [tokenizer.encode(t)[: length] for t in texts]
        ids = [p for p in ids if len(p) >= 2]
        if len(ids) < n_eval + 1:
            raise InvalidArgument(f"{source} gives {len(ids)} prompts; need more than the {n_eval} held out")
        held, train = ids[-n_eval:], ids[:-n_eval]
        order = torch.randperm(len(train), generator=gen).tolist()
        return [train[i] for i in order[:n_train]], held
    return _byte_prompts(n_train, length, gen), evaluation_prompts(n_eval, length, seed)


def _windows(tokenizer, data: torch.Tensor, n: int, length: int, gen: torch.Generator) -> list[list[int]]:
    """``n`` prompts: BOS + ``length`` - 1 bytes from random places of ``data`` (byte ids)."""
    starts = torch.randint(0, max(1, len(data) - length), (n,), generator=gen).tolist()
    text = [bytes(data[s : s + length - 1].tolist()).decode("utf-8", "replace") for s in starts]
    return [tokenizer.encode(t)[:length] for t in text]


def dataset_prompts(repo_id: str, revision: str | None = None) -> list[str]:
    """Prompts from every ``*.jsonl``/``*.json``/``*.txt`` file of a Hugging Face dataset repo (and
    ``*.parquet`` when pyarrow is installed), in path order (so the held-out ones, the last, are
    the same on every run). Fetched into the hub cache (``HF_HUB_OFFLINE=1``: cache only).
    Raises ``NotFound`` or ``InvalidArgument``."""
    from services.common.hub import DATASET_PATTERNS, resolve_dataset

    try:
        import pyarrow.parquet as pq
    except ImportError:
        pq = None
    patterns = DATASET_PATTERNS if pq else tuple(p for p in DATASET_PATTERNS if p != "*.parquet")
    root = resolve_dataset(repo_id, revision, patterns).path
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".jsonl", ".json", ".txt", ".parquet"))
    out = []
    for f in files:
        if f.suffix == ".parquet":
            if pq is None:
                continue
            out += [t for t in map(_record_prompt, pq.read_table(f).to_pylist()) if t]
        else:
            out += read_prompts(f)
    if not out:
        raise InvalidArgument(f"dataset {repo_id} has no prompts in *.jsonl, *.json or *.txt files"
                              + (" (*.parquet files are read only when pyarrow is installed)" if pq is None else ""))
    return out


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a file. JSONL (``.jsonl``/``.json`` lines) or a ``.json`` array of records:
    the first human/user turn of a ShareGPT ``conversations`` or chat ``messages`` record, else
    its ``prompt`` or ``text``. Plain text: paragraphs (blocks separated by blank lines). Raises
    ``InvalidArgument``."""
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"cannot read prompts from {path}: {exc}") from None
    if p.suffix == ".json":  # one JSON document (ShareGPT's own files are an array), else JSON lines
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if isinstance(doc, (list, dict)):  # a dict: one record, or metadata (dataset_info.json: no prompt)
            records = doc if isinstance(doc, list) else [doc]
            return [t for t in (_record_prompt(r) for r in records if isinstance(r, dict)) if t]
    if p.suffix in (".jsonl", ".json"):
        out = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                raise InvalidArgument(f"{p.name} line {n} is not JSON") from None
            text = _record_prompt(rec) if isinstance(rec, dict) else None
            if text:
                out.append(text)
        return out
    return [b.strip() for b in raw.split("\n\n") if b.strip()]


def _record_prompt(rec: dict) -> str | None:
    for key, who, what in (("conversations", "from", "value"), ("messages", "role", "content")):
        turns = rec.get(key)
        if isinstance(turns, list):
            for t in turns:
                if isinstance(t, dict) and t.get(who) in ("human", "user") and isinstance(t.get(what), str):
                    return t[what]
    for key in ("prompt", "text"):
        if isinstance(rec.get(key), str):
            return rec[key]
    return None


def _continuations(target: TargetModel, prompts: list[list[int]], gen_len: int, progress: bool) -> list[list[int]]:
    """prompt + the target's greedy continuation of ``gen_len`` tokens, for every prompt."""
    chunk = 32  # prompts per engine run: bounded KV memory
    out = []
    longest = max(len(p) for p in prompts)
    plain = build_local(models=(target, None), num_blocks=chunk * blocks_for(longest + gen_len, BLOCK_SIZE),
                        block_size=BLOCK_SIZE)
    bar = tqdm(total=len(prompts), desc="target continuations", disable=not progress)
    for i in range(0, len(prompts), chunk):
        part = prompts[i : i + chunk]
        out += [p + c.tokens for p, c in zip(part, generate(plain, part, max_new_tokens=gen_len))]
        bar.update(len(part))
    bar.close()
    return out


def _reduced_vocab_draft(target: TargetModel, draft: DraftModel, sequences: list[list[int]], n: int) -> DraftModel:
    """A fresh EAGLE-3 draft whose vocabulary is the ``n`` ids most used in ``sequences``
    (ties: lower id first), its other weights copied from ``draft``."""
    V = target.config.vocab_size
    if not 1 <= n <= V:
        raise InvalidArgument(f"--draft-vocab must be in 1..{V}")
    counts = torch.bincount(torch.tensor([t for s in sequences for t in s]), minlength=V).float()
    counts -= torch.arange(V) * 1e-9  # stable order among equal counts
    ids = torch.sort(torch.topk(counts, n).indices).values
    reduced = Eagle3Draft(target, dataclasses.replace(draft.config, draft_vocab_size=n if n != V else 0))
    own = {k: v for k, v in draft.draft_state_dict().items() if not k.startswith("lm_head.")}
    reduced.load_state_dict({**reduced.draft_state_dict(), **own}, strict=True)
    reduced.set_vocab_map(ids)
    return reduced


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
            out = d(nxt, hid[:, :m].reshape(b * m, -1), plan, self.backend, pool, context_is_aux=True,
                    draft_vocab_logits=True)
            # labels as draft ids; a target token outside a reduced draft vocabulary is not learnt
            target = d.t2d[lab[:, 1 : m + 1].reshape(-1)]
            loss = F.cross_entropy(out.logits, target, ignore_index=-1)
            # self-fed pass: position i reads g[i-1] (its own previous output) as chained drafting does
            g = out.hidden.view(b, m, -1)
            shifted = torch.cat([g[:, :1], g[:, :-1]], dim=1).reshape(b * m, -1)
            pool2 = d.new_kv_pool(b * per, BLOCK_SIZE)
            out2 = d(nxt, shifted, plan, self.backend, pool2, context_is_aux=False, draft_vocab_logits=True)
            return loss + 0.5 * F.cross_entropy(out2.logits, target, ignore_index=-1)
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
    ap.add_argument("--prompts", default=None, help="prompts: a text file (paragraphs) or JSONL (ShareGPT conversations, chat messages, prompt/text)")
    ap.add_argument("--dataset", default=None, help="prompts from a Hugging Face dataset repo (org/name): its *.jsonl, *.json and *.txt files (*.parquet with pyarrow), read as --prompts reads a file; HF_HUB_OFFLINE=1 uses the hub cache only")
    ap.add_argument("--dataset-revision", default=None, help="hub revision of --dataset (default: main)")
    ap.add_argument("--stdlib", action="store_true", help="prompts from the Python standard library's sources (held-out files for acceptance)")
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt (file prompts are cut to it)")
    ap.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts acceptance is measured on")
    ap.add_argument("--draft-model", default=None, help="start from this draft (folder or hub id; default: the model's own, else random)")
    ap.add_argument("--draft-vocab", type=int, default=0, help="EAGLE-3: train a reduced draft vocabulary of this many ids (0 = the whole vocabulary)")
    ap.add_argument("--save-dtype", choices=["float32", "bfloat16", "float16"], default=None, help="store the draft's weights in this dtype")


def run(args: argparse.Namespace) -> int:
    """Train, save, print acceptance before/after as JSON. Exit 2 on bad arguments."""
    out = args.out
    if out is None and str(args.model) == "tiny":
        out = str(distilled_tiny_dir(args.mode))
    try:
        result = distill_draft(
            args.model, out, args.steps, spec_mode=SpecMode[args.mode.upper()], mtp_depth=args.mtp_depth,
            num_sequences=args.sequences, gen_len=args.gen_len, batch_size=args.batch_size, lr=args.lr,
            k=args.k, seed=args.seed, prompts_file=args.prompts, stdlib=args.stdlib,
            dataset=args.dataset, dataset_revision=args.dataset_revision, prompt_len=args.prompt_len,
            eval_prompts=args.eval_prompts, draft_model=args.draft_model, draft_vocab=args.draft_vocab,
            save_dtype=getattr(torch, args.save_dtype) if args.save_dtype else None,
        )
    except (InvalidArgument, NotFound) as exc:
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
