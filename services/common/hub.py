"""Where a model or draft lives: a local folder, or a Hugging Face hub id (``org/name``) fetched
into the hub cache with ``huggingface_hub`` (progress bars while downloading; ``HF_HUB_OFFLINE=1``
uses the cache only; ``HF_HUB_CACHE`` / ``HF_HOME`` say where it is).

A hub snapshot is ``<cache>/models--org--name/snapshots/<commit>/``; the commit hash is the
model's identity (``services/gpuworker/model/identity.py``), so a ``--revision`` that moves gives a new namespace.
Dataset repos (``resolve_dataset``, prompts for ``tandem distill-draft --dataset``) live beside
them as ``datasets--org--name``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InvalidArgument, NotFound

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# what a model folder needs; *.bin only when a repo has no safetensors
_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt"]
# full=False: configuration and tokenizer only (tokenizer.json is a *.json)
# prompt files of a dataset repo that distill-draft reads (parquet needs pyarrow)
DATASET_PATTERNS = ("*.jsonl", "*.json", "*.txt", "*.parquet")


@dataclass(frozen=True)
class Resolved:
    """A folder on this machine, and where it came from (``commit`` is None for local folders)."""

    path: Path
    hub_id: str | None = None
    commit: str | None = None


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and not name.startswith((".", "/"))


def resolve(name: str, revision: str | None = None, *, full: bool = True) -> Resolved:
    """A local folder as is; otherwise a hub id, downloaded (or found in the cache; ``full=False``:
    its ``*.json`` files only, to check configuration before fetching weights). Raises
    ``NotFound`` (no such folder, repo, revision, or not cached while offline) or
    ``InvalidArgument`` (neither a folder nor a hub id)."""
    local = Path(name).expanduser()
    if local.is_dir():
        if revision:
            raise InvalidArgument(f"--revision applies to hub ids, and {name} is a local folder")
        return Resolved(local)
    if not looks_like_hub_id(name):
        raise NotFound(f"{name} is neither a folder nor a hub id (org/name)")
    return _download(name, revision, full)


def resolve_dataset(repo_id: str, revision: str | None = None, patterns: tuple[str, ...] = DATASET_PATTERNS) -> Resolved:
    """A Hugging Face dataset repo's files matching ``patterns`` (any folder depth), downloaded
    or found in the hub cache (``HF_HUB_OFFLINE=1``: cache only). Raises ``NotFound`` (no such
    repo or revision, not cached while offline) or ``InvalidArgument`` (not an ``org/name``)."""
    if not looks_like_hub_id(repo_id):
        raise InvalidArgument(f"{repo_id!r} is not a dataset id (org/name)")
    # huggingface_hub matches patterns with fnmatch, whose * crosses folders: data/train.jsonl too
    return _download(repo_id, revision, True, repo_type="dataset", patterns=list(patterns))


def _download(repo_id: str, revision: str | None, full: bool, *, repo_type: str = "model",
              patterns: list[str] | None = None) -> Resolved:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise NotFound(f"hub ids need huggingface_hub ({exc})") from None
    what = "hub repo" if repo_type == "model" else f"hub {repo_type} repo"
    try:
        if patterns is not None:
            path = Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=patterns))
        else:
            path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=_PATTERNS if full else ["*.json"]))
            if full and not any(path.glob("*.safetensors")):
                path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=["*.json", "*.bin"]))
    except GatedRepoError:
        raise NotFound(f"{repo_id} is gated: accept its licence on the hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise NotFound(f"no {what} {repo_id} (or it is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise NotFound(f"{repo_id} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        raise NotFound(
            f"{repo_id}{'@' + revision if revision else ''} is not in the hub cache and downloads are off "
            "(HF_HUB_OFFLINE) or the hub is unreachable"
        ) from None
    except (OSError, ValueError) as exc:
        raise NotFound(f"cannot fetch {repo_id}: {exc}") from None
    return Resolved(path, repo_id, path.name)
