"""Load (and save) a target + draft + tokenizer: the built-in ``tiny`` model (seeded random
weights, for tests), the shipped ``demo`` model, a Hugging Face style folder, or a hub id.

    model_dir/
      config.json                      LlamaConfig: llama, mistral, qwen2, qwen3 (config.py)
      model.safetensors                or model-0000k-of-0000n.safetensors + .index.json
      tokenizer.json                   (or tandem_tokenizer.json {"type": "byte"})
      eagle3/                          optional: its EAGLE-3 draft, public layout
                                       (config.json + model.safetensors, model/eagle3_format.py)
      tandem_draft.json                optional: an MTP draft (docs/drafts.md), or a legacy
      draft.safetensors                full-vocabulary EAGLE-3 draft

Where the draft comes from (``plan_model``): ``draft_model`` = a folder or hub id holding a
public EAGLE-3 draft or a ``tandem_draft.json`` draft; ``"random"``: seeded random weights
(benchmarks); unset: the model folder's own (``eagle3/`` or ``tandem_draft.json``). A folder
without one under a spec mode is an error, never a silent random draft; only the built-in
``tiny`` model, random itself, gets a random draft by default.

Everything that can be refused from configuration alone (unknown architecture, a draft made for
another target, EAGLE-3 on a target of fewer than 3 layers) is refused by ``plan_model``, which
reads config files only (for hub ids: ``config.json`` only), before any weight is read.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.common.errors import InvalidArgument, NotFound
from services.common.spec import SpecMode
from services.common import hub
from services.gpuworker.model import eagle3_format
from services.gpuworker.model.config import DraftConfig, LlamaConfig, tiny_config
from services.gpuworker.model.draft import DraftModel, Eagle3Draft, build_draft
from services.gpuworker.model.identity import content_fingerprint, digest, hub_fingerprint
from services.gpuworker.model.layers import init_weights
from services.gpuworker.model.llama import TargetModel
from services.common.tokenizer import BYTE_TOKENIZER_MARKER, ByteTokenizer, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

DRAFT_JSON = "tandem_draft.json"
DRAFT_WEIGHTS = "draft.safetensors"
EAGLE3_SUBDIR = "eagle3"
INDEX_JSON = "model.safetensors.index.json"
TINY_INIT_STD = 0.02
RANDOM_DRAFT = "random"
DEMO_DIR = Path(__file__).resolve().parent.parent / "demo_model"
BUILTIN = ("tiny", "demo")


@dataclass(frozen=True)
class ModelPlan:
    """What ``load_model`` will load, decided from configuration files alone.

    ``draft_kind``: None (no draft), ``random``, ``eagle3`` (public layout in ``draft_path``) or
    ``tandem`` (``tandem_draft.json`` in ``draft_path``)."""

    name: str
    target: hub.Resolved | None  # None: tiny
    config: LlamaConfig
    spec_mode: SpecMode
    draft_kind: str | None
    draft_source: hub.Resolved | None
    draft_config: DraftConfig | None


def resolve_model(name: str | Path, revision: str | None = None, *, full: bool = True) -> hub.Resolved | None:
    """None for ``tiny``; the shipped folder for ``demo``; else ``hub.resolve`` (``full=False``:
    for a hub id fetch ``config.json`` only)."""
    name = str(name)
    if name == "tiny":
        return None
    if name == "demo":
        if not (DEMO_DIR / "config.json").is_file():
            raise NotFound(f"the demo model is missing from {DEMO_DIR} (train it: docs/demo_model.md)")
        return hub.Resolved(DEMO_DIR)
    return hub.resolve(name, revision, full=full)


def plan_model(
    path_or_tiny: str | Path,
    *,
    spec_mode: SpecMode = SpecMode.NONE,
    mtp_depth: int = 1,
    draft_model: str | Path | None = None,
    revision: str | None = None,
    draft_revision: str | None = None,
    full: bool = False,
) -> ModelPlan:
    """Check that the model, spec mode and draft go together, reading configuration only.
    Raises ``InvalidArgument`` (they do not) or ``NotFound`` (a folder or repo is missing)."""
    if spec_mode is SpecMode.PARD:
        raise InvalidArgument("PARD drafts are separate models; the built-in loader has none")
    draft_model = str(draft_model) if draft_model else None
    if spec_mode is SpecMode.NONE and draft_model:
        raise InvalidArgument("--draft-model needs --spec-mode eagle3 or mtp")
    source = resolve_model(path_or_tiny, revision, full=full)
    if source is None:
        config = tiny_config()
    else:
        if not (source.path / "config.json").is_file():
            raise NotFound(f"no config.json in {source.path}")
        config = LlamaConfig.from_hf(_read_json(source.path / "config.json"))
    if spec_mode is SpecMode.NONE:
        return ModelPlan(str(path_or_tiny), source, config, spec_mode, None, None, None)
    wanted = DraftConfig.default_for(config, spec_mode, mtp_depth)  # refuses EAGLE-3 on < 3 layers
    if draft_model == RANDOM_DRAFT:
        return ModelPlan(str(path_or_tiny), source, config, spec_mode, RANDOM_DRAFT, None, wanted)
    if draft_model:
        draft_source = _draft_folder(hub.resolve(draft_model, draft_revision, full=full), spec_mode)
        kind, dcfg = _draft_in(draft_source.path, config, spec_mode, mtp_depth, explicit=True)
        return ModelPlan(str(path_or_tiny), source, config, spec_mode, kind, draft_source, dcfg)
    if source is not None:
        for folder in (source.path / EAGLE3_SUBDIR, source.path):
            found = _draft_in(folder, config, spec_mode, mtp_depth, explicit=False)
            if found is not None:
                return ModelPlan(str(path_or_tiny), source, config, spec_mode, found[0], hub.Resolved(folder), found[1])
    if source is None:  # the built-in tiny model is random anyway: so is its draft
        return ModelPlan(str(path_or_tiny), source, config, spec_mode, RANDOM_DRAFT, None, wanted)
    raise InvalidArgument(
        f"{path_or_tiny} has no {spec_mode.name} draft: give --draft-model PATH_OR_HUB_ID (e.g. a public "
        f"EAGLE-3 head), or --draft-model random for random weights (benchmarks only), or --spec-mode none"
    )


def _draft_folder(source: hub.Resolved, spec_mode: SpecMode) -> hub.Resolved:
    """A model folder given as the draft's source holds its EAGLE-3 draft in ``eagle3/``."""
    nested = source.path / EAGLE3_SUBDIR
    own = _read_json(source.path / "config.json")
    if spec_mode is SpecMode.EAGLE3 and not eagle3_format.is_eagle3_config(own) and nested.is_dir():
        return hub.Resolved(nested, source.hub_id, source.commit)
    return source


def _draft_in(folder: Path, target: LlamaConfig, spec_mode: SpecMode, mtp_depth: int, *, explicit: bool):
    """(kind, DraftConfig) of the draft ``folder`` holds for this mode, or None (``explicit``:
    raise instead, saying what is there)."""
    cfg = _read_json(folder / "config.json")
    if cfg and eagle3_format.is_eagle3_config(cfg):
        if spec_mode is not SpecMode.EAGLE3:
            if not explicit:
                return None
            raise InvalidArgument(f"{folder} holds an EAGLE-3 draft, and the spec mode is {spec_mode.name}")
        return "eagle3", eagle3_format.draft_config_from_json(cfg, target)
    section = _read_json(folder / DRAFT_JSON).get("draft")
    if section:
        stored = DraftConfig.from_json(section)
        same_depth = spec_mode is not SpecMode.MTP or stored.num_modules == mtp_depth
        if stored.spec_mode is spec_mode and same_depth:
            if stored.spec_mode is SpecMode.EAGLE3:
                DraftConfig.default_for(target, spec_mode)
            return "tandem", stored
        if explicit:
            raise InvalidArgument(
                f"{folder} holds a {stored.spec_mode.name} draft of {stored.num_modules} modules, "
                f"not the {spec_mode.name} draft asked for" + (f" (depth {mtp_depth})" if spec_mode is SpecMode.MTP else "")
            )
        return None
    if explicit:
        raise NotFound(f"no draft in {folder} (expected an EAGLE-3 config.json or {DRAFT_JSON})")
    return None


def load_model(
    path_or_tiny: str | Path,
    *,
    spec_mode: SpecMode = SpecMode.NONE,
    mtp_depth: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    draft_model: str | Path | None = None,
    revision: str | None = None,
    draft_revision: str | None = None,
    served_model_name: str | None = None,
) -> tuple[TargetModel, DraftModel | None, Tokenizer]:
    """Build the target, the draft for ``spec_mode`` (None for NONE) and the tokenizer.

    ``"tiny"``: built-in config, weights drawn from ``seed`` (draft from ``seed + 1``).
    ``"demo"``: the shipped demo model (with its EAGLE-3 draft). A folder or hub id (``revision``):
    config + safetensors (single file, sharded with an index, or every ``*.safetensors``).
    ``draft_model``: see the module docstring. Both models end up in eval mode on ``device`` in
    ``dtype``; ``target.fingerprint`` / ``draft.fingerprint`` identify their whole content (the
    kvstore namespace; ``served_model_name`` is mixed in when given). Raises ``NotFound`` /
    ``InvalidArgument`` for missing or unusable files."""
    plan = plan_model(path_or_tiny, spec_mode=spec_mode, mtp_depth=mtp_depth, draft_model=draft_model,
                      revision=revision, draft_revision=draft_revision, full=True)
    device = torch.device(device)
    if plan.target is None:
        config = plan.config
        target = TargetModel(config)
        init_weights(target, torch.Generator().manual_seed(seed), TINY_INIT_STD)
        config_bytes = json.dumps(config.to_hf(), sort_keys=True).encode()
        target.fingerprint = digest(b"tiny", config_bytes, str(seed).encode())
        tokenizer: Tokenizer = ByteTokenizer()
    else:
        folder = plan.target.path
        target = _load_target(folder, plan.config, dtype, device)
        target.fingerprint = _fingerprint(plan.target, [folder / "config.json", *_weight_files(folder)])
        tokenizer = load_tokenizer(folder)
    if served_model_name:
        target.fingerprint = digest(b"served", served_model_name.encode(), target.fingerprint.encode())
    target.to(device=device, dtype=dtype).eval()

    draft = None
    if plan.draft_kind is not None:
        draft = _load_draft(target, plan, seed)
        draft.to(device=device, dtype=dtype).eval()
    return target, draft, tokenizer


def load_draft(target: TargetModel, draft_model: str | Path, *, spec_mode: SpecMode, mtp_depth: int = 1,
               revision: str | None = None) -> DraftModel:
    """The draft in ``draft_model`` (a folder or hub id) for an already loaded ``target``, in
    the target's dtype and device, eval mode."""
    source = _draft_folder(hub.resolve(str(draft_model), revision), spec_mode)
    kind, config = _draft_in(source.path, target.config, spec_mode, mtp_depth, explicit=True)
    plan = ModelPlan(str(draft_model), None, target.config, spec_mode, kind, source, config)
    w = target.embed_tokens.weight
    return _load_draft(target, plan, seed=0).to(device=w.device, dtype=w.dtype).eval()


def _fingerprint(source: hub.Resolved, files: list[Path]) -> str:
    if source.commit and source.hub_id:
        return hub_fingerprint(source.hub_id, source.commit)
    return content_fingerprint(files)


def _load_draft(target: TargetModel, plan: ModelPlan, seed: int) -> DraftModel:
    if plan.draft_kind == RANDOM_DRAFT:
        wanted = plan.draft_config
        draft = build_draft(target, wanted)
        init_weights(draft, torch.Generator().manual_seed(seed + 1), TINY_INIT_STD)
        draft.fingerprint = digest(b"random-draft", json.dumps(wanted.to_json()).encode(), str(seed).encode())
        return draft
    folder = plan.draft_source.path
    if plan.draft_kind == "eagle3":
        files = _draft_weight_files(folder)
        draft = eagle3_format.load(folder, target, _read_tensors(files))
        draft.fingerprint = _fingerprint(plan.draft_source, [folder / "config.json", *files])
        return draft
    section = _read_json(folder / DRAFT_JSON)["draft"]
    draft = build_draft(target, plan.draft_config)
    weights = folder / str(section.get("weights", DRAFT_WEIGHTS))
    if not weights.is_file():
        raise NotFound(f"{DRAFT_JSON} names {weights.name}, which is missing")
    _load_draft_weights(draft, weights)
    draft.fingerprint = _fingerprint(plan.draft_source, [folder / DRAFT_JSON, weights])
    return draft


def _draft_weight_files(folder: Path) -> list[Path]:
    try:
        return _weight_files(folder)
    except NotFound:
        bins = sorted(folder.glob("pytorch_model*.bin"))
        if not bins:
            raise
        return bins


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of ``files`` (safetensors, or torch pickles read with ``weights_only``)."""
    out: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".bin":
            try:
                state = torch.load(str(file), map_location="cpu", weights_only=True)
            except Exception as exc:  # a pickle that is not plain tensors: refuse it
                raise InvalidArgument(f"cannot read {file.name} as plain tensors: {exc}") from None
            out.update({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
            continue
        with safe_open(str(file), framework="pt", device="cpu") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


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


def _load_draft_weights(draft: DraftModel, path: Path) -> None:
    """Fill a ``tandem_draft.json`` draft from its safetensors file (EAGLE-3 drafts of this
    layout named their layer ``layer.``; it is ``midlayer.`` now, as published drafts name it)."""
    own = draft.draft_state_dict()
    with safe_open(str(path), framework="pt", device="cpu") as f:
        stored = {("midlayer." + k[len("layer."):] if k.startswith("layer.") else k): k for k in f.keys()}
        missing = sorted(set(own) - set(stored))
        if missing:
            raise InvalidArgument(f"{path.name} lacks {len(missing)} tensors, e.g. {missing[:3]}")
        state = {k: f.get_tensor(stored[k]) for k in own}
    for k, t in state.items():
        if tuple(t.shape) != tuple(own[k].shape):
            raise InvalidArgument(f"{path.name}: {k} shape {list(t.shape)} != {list(own[k].shape)}")
    draft.load_state_dict(state, strict=True)


def save_draft(draft: DraftModel, model_dir: str | Path, *, dtype: torch.dtype | None = None,
               own_folder: bool = False) -> Path:
    """Save ``draft`` where ``load_model(model_dir, ...)`` finds it.

    EAGLE-3: the public layout (``eagle3_format.save``) in ``model_dir/eagle3/`` (``own_folder``:
    in ``model_dir`` itself, a folder for ``--draft-model``); returns that folder. MTP:
    ``draft.safetensors`` + the ``draft`` section of ``tandem_draft.json`` in ``model_dir``
    (other sections kept); returns the weights path."""
    if isinstance(draft, Eagle3Draft):
        return eagle3_format.save(draft, Path(model_dir) if own_folder else Path(model_dir) / EAGLE3_SUBDIR, dtype)
    folder = Path(model_dir)
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / DRAFT_WEIGHTS
    state = {k: v.detach().to(device="cpu", dtype=dtype or v.dtype).contiguous() for k, v in draft.draft_state_dict().items()}
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
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``target`` as a Hugging Face style folder (``config.json`` + ``model.safetensors``),
    plus the draft (``save_draft``) and a byte-tokenizer marker when given. ``dtype``: store the
    weights in it (e.g. bfloat16 to halve the files; default: as they are). Returns the folder."""
    folder = Path(model_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(target.config.to_hf(), indent=2) + "\n", encoding="utf-8")
    state = {}
    for name, p in target.named_parameters():  # a tied LM head is listed once, as embed_tokens
        key = name if name.startswith("lm_head.") else f"model.{name}"
        state[key] = p.detach().to(device="cpu", dtype=dtype or p.dtype).contiguous()
    save_file(state, str(folder / "model.safetensors"))
    if draft is not None:
        save_draft(draft, folder, dtype=dtype)
    if isinstance(tokenizer, ByteTokenizer):
        (folder / BYTE_TOKENIZER_MARKER).write_text(json.dumps({"type": "byte"}) + "\n", encoding="utf-8")
    return folder


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
