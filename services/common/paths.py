"""Where Tandem keeps files of its own on this machine (``$TANDEM_HOME``, default ~/.cache/tandem)."""

from __future__ import annotations

import os
from pathlib import Path


def tandem_home() -> Path:
    return Path(os.environ.get("TANDEM_HOME", Path.home() / ".cache" / "tandem"))


def distilled_tiny_dir(mode: str = "eagle3") -> Path:
    """Where ``tandem distill-draft tiny`` saves the tiny model with a trained draft; ``tandem up``
    serves it from there when present."""
    return tandem_home() / f"tiny-{mode}"
