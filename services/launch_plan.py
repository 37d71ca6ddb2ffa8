"""Where ``tandem up`` puts its workers: a pure function of what the machine has.

On a CUDA machine every worker gets one GPU of its own (``CUDA_VISIBLE_DEVICES`` set to that GPU,
so inside the worker it is ``cuda:0``), the FlashInfer backend, bf16, and KV pools sized as a
fraction of the GPU memory left free after the model loads (as vLLM/SGLang size theirs). On a
CPU machine: the torch backend, float32, and a fixed KV budget.

:func:`plan_workers` takes the facts as arguments (GPU count and free memory), so it is tested
with explicit inputs on CPU; :func:`detect_gpus` reads them from ``nvidia-smi`` (no CUDA context
is created in the launcher).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Literal

from services.common.startup import EXIT_CONFIG, EXIT_ENVIRONMENT, StartupError

GIB = 1 << 30
# A GPU with less free memory than this is busy (another job's model): no worker goes there.
MIN_FREE_BYTES = 2 * GIB
DEFAULT_GPU_KV_FRACTION = 0.9


@dataclass(frozen=True)
class Gpu:
    """One visible GPU: ``id`` is what CUDA_VISIBLE_DEVICES gets (its UUID from nvidia-smi)."""

    id: str
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class WorkerPlan:
    """How to start worker ``index``: its flags and extra environment."""

    index: int
    device: str
    backend: str
    dtype: str
    kv_memory_fraction: float | None
    env: dict[str, str] = field(default_factory=dict)

    def flags(self) -> list[str]:
        out = ["--device", self.device, "--backend", self.backend, "--dtype", self.dtype]
        if self.kv_memory_fraction is not None:
            out += ["--kv-memory-fraction", str(self.kv_memory_fraction)]
        return out


# head sizes FlashInfer's kernels are built for: the backend's own list (flashinfer_backend.py,
# which imports torch; a test keeps the two equal)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def plan_workers(
    *,
    device: Literal["auto", "cpu", "cuda"],
    gpus: list[Gpu],
    workers: int = 0,
    kv_memory_fraction: float | None = None,
    dtype: str | None = None,
    min_free_bytes: int = MIN_FREE_BYTES,
    cuda_torch: bool = True,
    flashinfer: bool = True,
    head_dim: int | None = None,
) -> tuple[list[WorkerPlan], list[str]]:
    """The workers to start and notes for the person (GPUs left out and why).

    ``workers`` 0 means one per usable GPU (one on CPU). ``cuda_torch``: the installed torch is a
    CUDA build (else ``auto`` stays on CPU); ``flashinfer``: FlashInfer is installed (else the
    torch backend runs on the GPU); ``head_dim``: the model's (FlashInfer's kernels exist for a few
    head sizes only; others run the torch backend on the GPU, with a note). Raises :class:`StartupError` when ``device='cuda'`` finds no
    usable GPU or no CUDA torch, or more workers are asked for than usable GPUs.
    """
    notes: list[str] = []
    if gpus and not cuda_torch:
        if device == "cuda":
            raise StartupError("--device cuda: the installed torch is a CPU build (TANDEM_TORCH=cuda bash scripts/up.sh installs the CUDA one)", EXIT_ENVIRONMENT)
        if device == "auto":
            notes.append("GPUs are visible but the installed torch is a CPU build: running on CPU "
                         "(TANDEM_TORCH=cuda bash scripts/up.sh installs the CUDA one)")
            gpus = []
    if device == "cpu" or (device == "auto" and not gpus):
        count = workers or 1
        return [WorkerPlan(i, "cpu", "torch", dtype or "float32", kv_memory_fraction) for i in range(count)], notes
    backend = "flashinfer"
    if not flashinfer:
        backend = "torch"
        notes.append("FlashInfer is not installed (pip install -e '.[gpu]'): the torch attention backend runs on the GPUs")
    elif head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        backend = "torch"
        notes.append(f"the model's head_dim {head_dim} has no FlashInfer kernels (sizes {FLASHINFER_HEAD_DIMS}): "
                     "the torch attention backend runs on the GPUs")
    usable = []
    for gpu in gpus:
        if gpu.free_bytes < min_free_bytes:
            notes.append(f"GPU {gpu.id} left out: {gpu.free_bytes / GIB:.1f} GiB free of {gpu.total_bytes / GIB:.1f} GiB (busy)")
        else:
            usable.append(gpu)
    if not usable:
        why = "no GPU is visible" if not gpus else "every visible GPU is busy"
        raise StartupError(f"--device cuda: {why} (need {min_free_bytes / GIB:.0f} GiB free on one)", EXIT_ENVIRONMENT)
    if workers > len(usable):
        raise StartupError(f"--workers {workers}: only {len(usable)} usable GPU(s); tandem up runs one worker per GPU", EXIT_CONFIG)
    # Most free memory first, so fewer workers than GPUs take the emptiest ones.
    chosen = sorted(usable, key=lambda g: -g.free_bytes)[: workers or len(usable)]
    fraction = DEFAULT_GPU_KV_FRACTION if kv_memory_fraction is None else kv_memory_fraction
    plans = [
        WorkerPlan(i, "cuda:0", backend, dtype or "bfloat16", fraction, {"CUDA_VISIBLE_DEVICES": gpu.id})
        for i, gpu in enumerate(chosen)
    ]
    return plans, notes


def visible_ids(cuda_visible_devices: str | None) -> list[str] | None:
    """The GPU ids ``CUDA_VISIBLE_DEVICES`` allows (None = all)."""
    if cuda_visible_devices is None:
        return None
    return [x.strip() for x in cuda_visible_devices.split(",") if x.strip()]


def parse_nvidia_smi(text: str, visible: list[str] | None) -> list[Gpu]:
    """GPUs from ``nvidia-smi --query-gpu=index,uuid,memory.free,memory.total
    --format=csv,noheader,nounits`` (MiB), filtered and ordered by ``visible``."""
    rows, order = {}, []
    for line in text.strip().splitlines():
        index, uuid, free_mib, total_mib = (x.strip() for x in line.split(","))
        # Pinned by UUID: an index means another GPU to CUDA than to nvidia-smi unless
        # CUDA_DEVICE_ORDER=PCI_BUS_ID, a UUID never does.
        rows[index] = rows[uuid] = Gpu(uuid, int(float(free_mib)) << 20, int(float(total_mib)) << 20)
        order.append(index)
    wanted = order if visible is None else visible
    return [rows[v] for v in wanted if v in rows]


def installed_capabilities() -> tuple[bool, bool]:
    """(the installed torch is a CUDA build, FlashInfer is installed); imports torch, not CUDA."""
    import importlib.util

    import torch

    return torch.version.cuda is not None, importlib.util.find_spec("flashinfer") is not None


def detect_gpus(cuda_visible_devices: str | None) -> list[Gpu]:
    """The visible GPUs with their free memory, or [] where there is no NVIDIA driver."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,uuid,memory.free,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_nvidia_smi(out, visible_ids(cuda_visible_devices))
