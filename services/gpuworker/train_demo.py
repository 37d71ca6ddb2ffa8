"""``tandem train-demo``: train the built-in demo model, a small byte-level Llama, on the Python
standard library's own sources (text that ships with every Python installation).

    stdlib *.py (sorted; tests, idlelib, site-packages left out) ──split by path hash──▶
        train files (~95 %)  ─random windows of ``seq_len`` bytes─▶ next-byte cross-entropy
        held-out files (~5 %) ─fixed windows─▶ held-out loss in the log; acceptance of the draft

Reproducible: the corpus is this interpreter's stdlib (its version is written into the log and
``tandem_demo.json``), windows and init come from ``--seed``, the schedule from ``--steps``. The
run logs progress (loss, held-out loss, tokens/s, ETA, a greedy sample) and writes a checkpoint
every ``--save-every`` steps, so a run stopped early still leaves a servable model. The shipped
model (``services/gpuworker/demo_model``) came from the command in docs/demo_model.md; its
EAGLE-3 draft from ``tandem distill-draft`` on the same corpus.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from services.common.spec import SpecMode
from services.common.tokenizer import TINY_BOS_ID, TINY_EOS_ID, TINY_VOCAB_SIZE, ByteTokenizer
from services.gpuworker.model.config import LlamaConfig
from services.gpuworker.model.dense import dense_forward
from services.gpuworker.model.layers import init_weights
from services.gpuworker.model.llama import TargetModel
from services.gpuworker.model.loader import load_draft, load_model, save_draft, save_model

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3",
             "turtledemo", "tkinter", "ensurepip", "config-3"}
HELD_OUT_EVERY = 20  # a file is held out when sha256(relative path) % 20 == 0
DEMO_META = "tandem_demo.json"


def demo_config(head_dim: int = 64) -> LlamaConfig:
    """The demo model: byte vocabulary (as ``tiny``), 6 layers, hidden 256, GQA 8/4 heads of 64,
    ~6.2 M params. Heads of 64 because FlashInfer has kernels for 64/128/256 only: the GPU path
    then runs FlashInfer and CUDA graphs instead of the torch backend. ``head_dim=32``: the first
    shipped model's shape (``--init-from`` widens such a checkpoint exactly, see ``widen_heads``)."""
    return LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_layers=6, num_heads=8,
        num_kv_heads=4, head_dim=head_dim, max_seq_len=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=TINY_BOS_ID, eos_token_ids=(TINY_EOS_ID,),
    )


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """Every ``*.py`` of the standard library under ``root`` (default: this interpreter's), in
    sorted order, without test suites, GUI demos and installed packages."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(base.rglob("*.py")):
        rel = p.relative_to(base).parts
        if any(part in SKIP_DIRS or part.startswith("config-") for part in rel[:-1]):
            continue
        out.append(p)
    return out


def is_held_out(path: Path, root: Path) -> bool:
    rel = str(path.relative_to(root)).encode()
    return int.from_bytes(hashlib.sha256(rel).digest()[:8], "little") % HELD_OUT_EVERY == 0


def split_corpus(root: str | Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files) of the stdlib, split by a hash of each relative path."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(base)
    held = [p for p in files if is_held_out(p, base)]
    held_set = set(held)
    return [p for p in files if p not in held_set], held


def corpus_bytes(files: list[Path]) -> torch.Tensor:
    """The files' bytes joined by blank lines, as int64 ids [N] (bytes are ids 0..255)."""
    chunks = []
    for p in files:
        try:
            chunks.append(p.read_bytes())
        except OSError:
            continue
    data = b"\n\n".join(chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def held_out_text(n: int, length: int, root: str | Path | None = None) -> list[str]:
    """``n`` prompts of ``length`` bytes cut at evenly spaced places of the held-out files
    (deterministic; never trained on)."""
    _, held = split_corpus(root)
    data = corpus_bytes(held)
    step = max(1, (len(data) - length) // max(n, 1))
    return [bytes(data[i * step : i * step + length].tolist()).decode("utf-8", "replace") for i in range(n)]


def widen_heads(old: TargetModel, new: TargetModel, noise_std: float = 1e-3, seed: int = 0) -> None:
    """Copy ``old`` into ``new``, whose attention heads are twice as wide (same head counts), so
    that ``new`` computes what ``old`` does (up to ``noise_std``). Mutates ``new``.

    Head dim d -> 2d with rotate-half RoPE: old pair (j, j + d/2) turns at frequency index j of
    d/2, which is index 2j of d, so old dim j goes to new dim 2j and old dim j + d/2 to 2j + d;
    q is scaled by sqrt(2) because the attention scale goes from 1/sqrt(d) to 1/sqrt(2d). The new
    dims get small noise instead of zeros: zero q and k pads (and v and o pads) would have zero
    gradients for each other and never learn."""
    oc, nc = old.config, new.config
    _check_widening(oc, nc)
    new.load_state_dict(_widened(old.state_dict(), new.state_dict(), oc, noise_std, seed), strict=True)


def widen_draft(old_draft, new_target: TargetModel, noise_std: float = 1e-3, seed: int = 0):
    """An EAGLE-3 draft of ``new_target`` (heads twice as wide) computing what ``old_draft`` does
    (``widen_heads`` for its one layer; fc, MLP, norms, LM head and vocabulary map copied): the
    starting point ``distill-draft`` fine-tunes after ``--init-from`` widened the target."""
    import dataclasses

    from services.gpuworker.model.draft import Eagle3Draft

    olc = old_draft.layer_config
    cfg = dataclasses.replace(old_draft.config, layer=dataclasses.replace(olc, head_dim=2 * olc.head_dim))
    new = Eagle3Draft(new_target, cfg)
    _check_widening(olc, new.layer_config)
    new.load_state_dict(_widened(old_draft.draft_state_dict(), new.draft_state_dict(), olc, noise_std, seed), strict=True)
    new.set_vocab_map(old_draft.d2t)
    return new


def _check_widening(oc: LlamaConfig, nc: LlamaConfig) -> None:
    if nc.head_dim != 2 * oc.head_dim or (nc.num_heads, nc.num_kv_heads) != (oc.num_heads, oc.num_kv_heads):
        raise ValueError(f"widening doubles head_dim at equal head counts; got {oc} -> {nc}")


def _widened(old_sd: dict, new_sd: dict, oc: LlamaConfig, noise_std: float, seed: int) -> dict:
    d = oc.head_dim
    j = torch.arange(d // 2)
    slots = torch.cat([2 * j, 2 * j + d])  # where old dims 0..d-1 land in a head of 2d
    gen = torch.Generator().manual_seed(seed)

    def rows(w_old: torch.Tensor, heads: int, scale: float = 1.0) -> torch.Tensor:  # [heads*d, in] -> [heads*2d, in]
        out = torch.randn(heads, 2 * d, w_old.shape[1], generator=gen) * noise_std
        out[:, slots] = w_old.view(heads, d, -1) * scale
        return out.reshape(heads * 2 * d, -1)

    out = {}
    for name, w in new_sd.items():
        ow = old_sd[name].float()
        if name.endswith("q_proj.weight"):
            out[name] = rows(ow, oc.num_heads, math.sqrt(2.0))
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            out[name] = rows(ow, oc.num_kv_heads)
        elif name.endswith("o_proj.weight"):
            out[name] = rows(ow.t().contiguous(), oc.num_heads).t().contiguous()
        elif w.shape == ow.shape:
            out[name] = ow
        else:
            raise ValueError(f"widening: {name} has shape {tuple(ow.shape)}, expected {tuple(w.shape)}")
    return out


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak``, then cosine decay to 0 at the last step: a short run is only
    as good as its annealed end (the first shipped model stopped at peak LR and looped)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step + 1 - warmup) / max(1, steps - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


@torch.no_grad()
def greedy_sample(model: TargetModel, prompt: str, n: int = 160) -> str:
    """Greedy continuation with the dense forward (no KV cache: for logs only)."""
    ids = torch.tensor([[TINY_BOS_ID, *prompt.encode()]])
    for _ in range(n):
        hidden, _ = dense_forward(model, ids[:, -512:])
        ids = torch.cat([ids, model.lm_head(hidden[:, -1]).argmax(-1, keepdim=True)], dim=1)
    return ByteTokenizer().decode(ids[0, 1:].tolist())


def train(out_dir: str | Path, *, steps: int, batch_size: int, seq_len: int, lr: float, seed: int,
          save_every: int, log_every: int, threads: int, init_from: str | None = None, warmup: int = 100,
          log=print) -> Path:
    """Train (from scratch, or from ``init_from``: a demo checkpoint of this shape or of the
    first shipped one, heads of 32, widened exactly) and save to ``out_dir`` (bf16 safetensors +
    byte tokenizer marker)."""
    torch.manual_seed(seed)
    if threads:
        torch.set_num_threads(threads)
    train_files, held_files = split_corpus()
    data, held = corpus_bytes(train_files), corpus_bytes(held_files)
    log(f"python {sys.version.split()[0]} stdlib: {len(train_files)} train files ({len(data)/1e6:.1f} MB), "
        f"{len(held_files)} held out ({len(held)/1e6:.2f} MB)")
    config = demo_config()
    model = TargetModel(config)
    init_weights(model, torch.Generator().manual_seed(seed), 0.02)
    draft = None  # init_from's EAGLE-3 draft, widened with the target: distill-draft's starting point
    if init_from:
        old = load_model(init_from)[0]  # float32
        if old.config.head_dim == config.head_dim:
            model.load_state_dict(old.state_dict(), strict=True)
        else:
            widen_heads(old, model, seed=seed)
            if (Path(init_from) / "eagle3").is_dir():
                draft = widen_draft(load_draft(old, Path(init_from) / "eagle3", spec_mode=SpecMode.EAGLE3), model, seed=seed)
        log(f"initialized from {init_from} (head_dim {old.config.head_dim} -> {config.head_dim}"
            f"{'; its EAGLE-3 draft widened too' if draft is not None else ''})")
    log(f"model: {sum(p.numel() for p in model.parameters())/1e6:.2f} M params, {config}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed + 1)
    held_idx = torch.linspace(0, len(held) - seq_len - 2, 16).long()
    held_batch = _with_bos(torch.stack([held[i : i + seq_len] for i in held_idx]))
    meta = {"python": sys.version.split()[0], "steps": steps, "batch_size": batch_size, "seq_len": seq_len,
            "lr": lr, "warmup": warmup, "schedule": "linear warm-up, cosine to 0", "seed": seed,
            "init_from": str(init_from) if init_from else None,
            "train_files": len(train_files), "held_out_files": len(held_files)}
    t0, tokens = time.time(), 0
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=min(warmup, steps // 10 + 1))
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        batch = _with_bos(torch.stack([data[s : s + seq_len] for s in starts.tolist()]))
        # float32: CPUs without bf16 instructions run autocast bf16 many times slower (measured
        # 35x on the build VM's AVX2 cores); the bf16 cast happens once, when saving
        hidden, _ = dense_forward(model, batch[:, :-1])
        logits = model.lm_head(hidden)
        loss = F.cross_entropy(logits.float().reshape(-1, config.vocab_size), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += batch_size * seq_len
        done = step + 1
        if done % log_every == 0 or done == steps:
            el = time.time() - t0
            with torch.no_grad():
                h, _ = dense_forward(model, held_batch[:, :-1])
                held_loss = F.cross_entropy(model.lm_head(h).float().reshape(-1, config.vocab_size),
                                            held_batch[:, 1:].reshape(-1))
            log(f"step {done}/{steps} loss {loss.item():.3f} held-out {held_loss.item():.3f} "
                f"({held_loss.item()/math.log(2):.2f} bits/byte) {tokens/el:.0f} tok/s "
                f"elapsed {el/60:.1f} min ETA {(steps-done)*el/done/60:.1f} min")
        if done % save_every == 0 or done == steps:
            _save(model, out_dir, {**meta, "steps_done": done, "held_out_loss": float(held_loss)}, draft)
            log(f"saved step {done} to {out_dir}; sample: {greedy_sample(model, 'def ')!r}")
    return Path(out_dir)


def _with_bos(windows: torch.Tensor) -> torch.Tensor:
    # served prompts start with BOS and then text from anywhere in a file: train on the same
    return torch.cat([torch.full((windows.shape[0], 1), TINY_BOS_ID), windows], dim=1)


def _save(model: TargetModel, out_dir: str | Path, meta: dict, draft=None) -> None:
    folder = save_model(model, out_dir, tokenizer=ByteTokenizer(), dtype=torch.bfloat16)
    if draft is not None:
        save_draft(draft, folder, dtype=torch.bfloat16)
    (folder / DEMO_META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", required=True, help="output model folder")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=300)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--warmup", type=int, default=100, help="warm-up steps (capped at a tenth of --steps)")
    ap.add_argument("--init-from", default=None, help="start from this demo checkpoint (a folder; heads of 32 are widened to 64 exactly)")


def run(args: argparse.Namespace) -> int:
    for name in ("steps", "batch_size", "seq_len", "save_every", "log_every"):
        if getattr(args, name) < 1:
            print(f"train-demo: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    train(args.out, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
          seed=args.seed, save_every=args.save_every, log_every=args.log_every, threads=args.threads,
          init_from=args.init_from, warmup=args.warmup, log=log)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem train-demo", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
