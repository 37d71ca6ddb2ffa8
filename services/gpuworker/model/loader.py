"""Load (and save) a target + draft + tokenizer: the built-in ``tiny`` model or a Hugging Face
style folder.

    model_dir/
      config.json                      LlamaConfig (transformers v4 or v5 spelling)
      model.safetensors                or model-0000k-of-0000n.safetensors + .index.json
      tokenizer.json                   (or tandem_tokenizer.json {"type": "byte"})
      tandem_draft.json                {"draft": {spec_mode, num_modules, intermediate_size,
                                                  aux_layers, weights: "draft.safetensors"}}
      draft.safetensors                draft-only weights (no shared embedding / LM head)

A requested draft that the folder does not hold (no ``tandem_draft.json``, or one for another
mode/depth) gets seeded random weights: it runs, proposes badly, and ``tandem distill-draft`` can
train it and ``save_draft`` it next to the model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.common.errors import InvalidArgument, NotFound
from services.common.spec import SpecMode
from services.gpuworker.model.config import DraftConfig, LlamaConfig, tiny_config
from services.gpuworker.model.draft import DraftModel, build_draft
from services.gpuworker.model.layers import init_weights
from services.gpuworker.model.llama import TargetModel
from services.common.tokenizer import BYTE_TOKENIZER_MARKER, ByteTokenizer, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

DRAFT_JSON = "tandem_draft.json"
DRAFT_WEIGHTS = "draft.safetensors"
INDEX_JSON = "model.safetensors.index.json"
TINY_INIT_STD = 0.02


def load_model(
    path_or_tiny: str | Path,
    *,
    spec_mode: SpecMode = SpecMode.NONE,
    mtp_depth: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    draft_dir: str | Path | None = None,
) -> tuple[TargetModel, DraftModel | None, Tokenizer]:
    """Build the target, the draft for ``spec_mode`` (None for NONE) and the tokenizer.

    ``"tiny"``: built-in config, weights drawn from ``seed`` (draft from ``seed + 1``). A folder:
    config + safetensors (single file, sharded with an index, or every ``*.safetensors``).
    ``draft_dir``: take the draft from that folder (``tandem_draft.json`` + weights, as
    ``save_draft`` writes) instead of the model folder; it must hold one.
    Both models end up in eval mode on ``device`` in ``dtype``; ``target.fingerprint`` and
    ``draft.fingerprint`` identify the weights (for the kvstore namespace). Raises ``NotFound``
    / ``InvalidArgument`` for missing or unusable files."""
    if spec_mode is SpecMode.PARD:
        raise InvalidArgument("PARD drafts are separate models; the built-in loader has none")
    device = torch.device(device)
    if str(path_or_tiny) == "tiny":
        config = tiny_config()
        target = TargetModel(config)
        init_weights(target, torch.Generator().manual_seed(seed), TINY_INIT_STD)
        config_bytes = json.dumps(config.to_hf(), sort_keys=True).encode()
        target.fingerprint = _digest(b"tiny", config_bytes, str(seed).encode())
        tokenizer: Tokenizer = ByteTokenizer()
        folder = None
    else:
        folder = Path(path_or_tiny)
        if not (folder / "config.json").is_file():
            raise NotFound(f"no config.json in {folder}")
        config = LlamaConfig.from_hf(_read_json(folder / "config.json"))
        target = _load_target(folder, config, dtype, device)
        tokenizer = load_tokenizer(folder)
    target.to(device=device, dtype=dtype).eval()

    draft = None
    if spec_mode is not SpecMode.NONE:
        if draft_dir is not None and not _read_json(Path(draft_dir) / DRAFT_JSON).get("draft"):
            raise NotFound(f"no draft in {draft_dir} (expected {DRAFT_JSON} with a 'draft' section)")
        draft = _load_or_init_draft(target, Path(draft_dir) if draft_dir is not None else folder, spec_mode, mtp_depth, seed)
        draft.to(device=device, dtype=dtype).eval()
    return target, draft, tokenizer


def _load_target(folder: Path, config: LlamaConfig, dtype: torch.dtype, device: torch.device) -> TargetModel:
    """Build without initializing (meta), allocate on ``device`` in ``dtype``, fill from the files:
    a big model never exists twice or in float32 on the way."""
    files = _weight_files(folder)
    with torch.device("meta"):
        target = TargetModel(config)
    target.to(dtype=dtype).to_empty(device=device)
    target.rotary.reset_tables()
    if config.tie_word_embeddings:  # to_empty broke the tie; restore it before loading
        target.lm_head.weight = target.embed_tokens.weight
    wanted = {f"model.{k}" if not k.startswith("lm_head.") else k: k for k in _param_names(target)}
    if config.tie_word_embeddings:
        wanted.pop("lm_head.weight", None)
    found: set[str] = set()
    params = dict(target.named_parameters())
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    ours = wanted.get(name)
                    if ours is None:
                        continue
                    t = f.get_tensor(name)
                    p = params[ours]
                    if tuple(t.shape) != tuple(p.shape):
                        raise InvalidArgument(f"{name}: shape {list(t.shape)} != expected {list(p.shape)}")
                    p.copy_(t)
                    found.add(name)
    missing = sorted(set(wanted) - found)
    if missing:
        raise InvalidArgument(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    target.fingerprint = _digest(
        (folder / "config.json").read_bytes(), *(_safetensors_header(f) for f in files)
    )
    return target


def _param_names(module: torch.nn.Module) -> list[str]:
    # named_parameters() lists a tied tensor once (under embed_tokens), as wanted
    return [n for n, _ in module.named_parameters()]


def _weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_JSON
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InvalidArgument(f"{INDEX_JSON} has no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(p for p in folder.glob("*.safetensors") if p.name != DRAFT_WEIGHTS)
    if not files:
        raise NotFound(f"no *.safetensors weights in {folder}")
    for f in files:
        if not f.is_file():
            raise NotFound(f"weight file {f.name} named by the index is missing")
    return files


def _load_or_init_draft(
    target: TargetModel, folder: Path | None, spec_mode: SpecMode, mtp_depth: int, seed: int
) -> DraftModel:
    wanted = DraftConfig.default_for(target.config, spec_mode, mtp_depth)
    section = _read_json(folder / DRAFT_JSON).get("draft") if folder else None
    if section:
        stored = DraftConfig.from_json(section)
        same_depth = spec_mode is not SpecMode.MTP or stored.num_modules == mtp_depth
        if stored.spec_mode is spec_mode and same_depth:
            draft = build_draft(target, stored)
            weights = folder / str(section.get("weights", DRAFT_WEIGHTS))
            if not weights.is_file():
                raise NotFound(f"{DRAFT_JSON} names {weights.name}, which is missing")
            _load_draft_weights(draft, weights)
            draft.fingerprint = _digest((folder / DRAFT_JSON).read_bytes(), _safetensors_header(weights))
            return draft
        log.warning(
            "%s holds a %s draft (%d modules); drawing random %s weights",
            DRAFT_JSON, stored.spec_mode.name, stored.num_modules, spec_mode.name,
        )
    draft = build_draft(target, wanted)
    init_weights(draft, torch.Generator().manual_seed(seed + 1), TINY_INIT_STD)
    draft.fingerprint = _digest(b"random-draft", json.dumps(wanted.to_json()).encode(), str(seed).encode())
    return draft


def _load_draft_weights(draft: DraftModel, path: Path) -> None:
    own = draft.draft_state_dict()
    with safe_open(str(path), framework="pt", device="cpu") as f:
        keys = set(f.keys())
        missing = sorted(set(own) - keys)
        if missing:
            raise InvalidArgument(f"{path.name} lacks {len(missing)} tensors, e.g. {missing[:3]}")
        state = {k: f.get_tensor(k) for k in own}
    for k, t in state.items():
        if tuple(t.shape) != tuple(own[k].shape):
            raise InvalidArgument(f"{path.name}: {k} shape {list(t.shape)} != {list(own[k].shape)}")
    draft.load_state_dict(state, strict=True)


def save_draft(draft: DraftModel, model_dir: str | Path) -> Path:
    """Write ``draft.safetensors`` and the ``draft`` section of ``tandem_draft.json`` into
    ``model_dir`` (other sections of that file are kept). Returns the weights path."""
    folder = Path(model_dir)
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / DRAFT_WEIGHTS
    state = {k: v.detach().to("cpu").contiguous() for k, v in draft.draft_state_dict().items()}
    save_file(state, str(weights))
    meta = _read_json(folder / DRAFT_JSON)
    meta["draft"] = {**draft.config.to_json(), "weights": DRAFT_WEIGHTS}
    (folder / DRAFT_JSON).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return weights


def save_model(
    target: TargetModel,
    model_dir: str | Path,
    *,
    draft: DraftModel | None = None,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write ``target`` as a Hugging Face style folder (``config.json`` + ``model.safetensors``),
    plus the draft (``save_draft``) and a byte-tokenizer marker when given. Returns the folder."""
    folder = Path(model_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(target.config.to_hf(), indent=2) + "\n", encoding="utf-8")
    state = {}
    for name, p in target.named_parameters():  # a tied LM head is listed once, as embed_tokens
        key = name if name.startswith("lm_head.") else f"model.{name}"
        state[key] = p.detach().to("cpu").contiguous()
    save_file(state, str(folder / "model.safetensors"))
    if draft is not None:
        save_draft(draft, folder)
    if isinstance(tokenizer, ByteTokenizer):
        (folder / BYTE_TOKENIZER_MARKER).write_text(json.dumps({"type": "byte"}) + "\n", encoding="utf-8")
    return folder


def _safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file (names, dtypes, shapes, offsets): cheap to read and
    changes whenever the layout does, plus the first MiB of values (hashing every value of a big
model would take too long at start)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = f.read(n)
        sample = f.read(1 << 20)  # the first MiB of values tells fine-tunes of one layout apart
    return header + sample + str(path.stat().st_size).encode()


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read {path.name}: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidArgument(f"{path.name} must hold a JSON object")
    return data
