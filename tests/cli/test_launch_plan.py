"""Where ``tandem up`` puts workers, from explicit machine facts (GPU count, free memory), and how
a worker sizes its KV pools from free memory."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.common.startup import EXIT_CONFIG, EXIT_ENVIRONMENT, StartupError
from services.launch_plan import GIB, Gpu, parse_nvidia_smi, plan_workers, visible_ids


def gpus(*free_gib: float, total_gib: float = 80) -> list[Gpu]:
    return [Gpu(str(i), int(f * GIB), int(total_gib * GIB)) for i, f in enumerate(free_gib)]


def test_no_gpu_means_one_cpu_worker_on_torch_float32():
    plans, notes = plan_workers(device="auto", gpus=[])
    assert [(p.device, p.backend, p.dtype, p.kv_memory_fraction, p.env) for p in plans] == [("cpu", "torch", "float32", None, {})]
    assert notes == []
    assert len(plan_workers(device="auto", gpus=[], workers=3)[0]) == 3


def test_one_worker_per_gpu_pinned_flashinfer_bf16_and_kv_fraction():
    plans, _ = plan_workers(device="auto", gpus=gpus(70, 75, 79))
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["2", "1", "0"]  # most free memory first
    assert {(p.device, p.backend, p.dtype, p.kv_memory_fraction) for p in plans} == {("cuda:0", "flashinfer", "bfloat16", 0.9)}
    assert plans[0].flags() == ["--device", "cuda:0", "--backend", "flashinfer", "--dtype", "bfloat16", "--kv-memory-fraction", "0.9"]


def test_fewer_workers_take_the_emptiest_gpus_and_overrides_pass_through():
    plans, _ = plan_workers(device="cuda", gpus=gpus(10, 60, 30), workers=2, kv_memory_fraction=0.5, dtype="float16")
    assert [(p.index, p.env["CUDA_VISIBLE_DEVICES"], p.dtype, p.kv_memory_fraction) for p in plans] == [
        (0, "1", "float16", 0.5), (1, "2", "float16", 0.5)]


def test_busy_gpus_are_left_out_with_a_note():
    plans, notes = plan_workers(device="auto", gpus=gpus(0.5, 40))
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["1"]
    assert notes == ["GPU 0 left out: 0.5 GiB free of 80.0 GiB (busy)"]


def test_cpu_forced_on_a_gpu_machine():
    plans, _ = plan_workers(device="cpu", gpus=gpus(70, 70))
    assert [p.device for p in plans] == ["cpu"]


@pytest.mark.parametrize("kw,code,fragment", [
    (dict(device="cuda", gpus=[]), EXIT_ENVIRONMENT, "no GPU is visible"),
    (dict(device="cuda", gpus=gpus(0.1)), EXIT_ENVIRONMENT, "every visible GPU is busy"),
    (dict(device="auto", gpus=gpus(50, 50), workers=3), EXIT_CONFIG, "--workers 3: only 2 usable GPU(s)"),
])
def test_impossible_plans_are_startup_errors(kw, code, fragment):
    with pytest.raises(StartupError) as info:
        plan_workers(**kw)
    assert info.value.exit_code == code and fragment in info.value.message


def test_nvidia_smi_rows_filtered_by_cuda_visible_devices():
    text = "0, GPU-aaa, 81000, 81559\n1, GPU-bbb, 1000, 81559\n2, GPU-ccc, 40000, 81559\n"
    assert [g.id for g in parse_nvidia_smi(text, None)] == ["GPU-aaa", "GPU-bbb", "GPU-ccc"]
    assert parse_nvidia_smi(text, visible_ids("2,GPU-aaa")) == [Gpu("GPU-ccc", 40000 << 20, 81559 << 20), Gpu("GPU-aaa", 81000 << 20, 81559 << 20)]
    plans, notes = plan_workers(device="auto", gpus=parse_nvidia_smi(text, None))
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["GPU-aaa", "GPU-ccc"] and "GPU GPU-bbb left out" in notes[0]
    assert parse_nvidia_smi(text, visible_ids("")) == []


def test_worker_kv_budget_from_fraction_of_free_memory():
    import torch

    from services.gpuworker.model.loader import load_model
    from services.gpuworker.build import kv_budget_bytes, pool_blocks
    from services.gpuworker.settings import WorkerSettings

    free = lambda: 10 * GIB  # noqa: E731
    assert kv_budget_bytes(WorkerSettings(), "cuda", free) == int(0.9 * 10 * GIB)  # CUDA default
    assert kv_budget_bytes(WorkerSettings(kv_memory_fraction=0.5), "cpu", free) == 5 * GIB
    assert kv_budget_bytes(WorkerSettings(kv_memory_mb=64), "cpu", free) == 64 << 20  # CPU default: the fixed budget
    target, draft, _ = load_model("tiny")
    per_gib = pool_blocks(WorkerSettings(), target, draft, torch.float32, 1 << 30)
    assert pool_blocks(WorkerSettings(), target, draft, torch.float32, 2 << 30) in (2 * per_gib, 2 * per_gib + 1)
    assert pool_blocks(WorkerSettings(num_blocks=7), target, draft, torch.float32, 1 << 30) == 7
    assert pool_blocks(WorkerSettings(max_num_blocks=100), target, draft, torch.float32, 1 << 30) == 100 < per_gib
    with pytest.raises(InvalidArgument, match="holds no block"):
        pool_blocks(WorkerSettings(), target, draft, torch.float32, 10)


def test_gpus_with_a_cpu_torch_stay_on_cpu_and_missing_flashinfer_falls_back_to_torch():
    plans, notes = plan_workers(device="auto", gpus=gpus(70, 70), cuda_torch=False)
    assert [p.device for p in plans] == ["cpu"] and "CPU build" in notes[0]
    with pytest.raises(StartupError) as info:
        plan_workers(device="cuda", gpus=gpus(70), cuda_torch=False)
    assert info.value.exit_code == EXIT_ENVIRONMENT
    plans, notes = plan_workers(device="auto", gpus=gpus(70, 70), flashinfer=False)
    assert {(p.device, p.backend, p.dtype) for p in plans} == {("cuda:0", "torch", "bfloat16")} and len(plans) == 2
    assert "FlashInfer is not installed" in notes[0]


def test_worker_command_line_carries_the_plan_and_the_passthrough_flags():
    from services.launcher import UpSettings, worker_argv

    s = UpSettings(model="/models/m", draft_model="/models/d", spec_mode="mtp")
    gpu_plan = plan_workers(device="auto", gpus=gpus(70, 70))[0][1]
    argv = worker_argv(s, gpu_plan, 50062, "127.0.0.1:50051")
    joined = " ".join(argv)
    assert "--worker-id worker1 --model /models/m --spec-mode mtp --num-blocks 0" in joined  # pools sized by fraction
    assert "--device cuda:0 --backend flashinfer --dtype bfloat16 --kv-memory-fraction 0.9 --draft-model /models/d" in joined
    cpu_plan = plan_workers(device="cpu", gpus=[])[0][0]
    assert "--num-blocks 1024 --device cpu --backend torch --dtype float32" in " ".join(worker_argv(UpSettings(), cpu_plan, 0, "x:1"))
    hub = UpSettings(model="org/m", revision="v2", draft_model="org/d", draft_revision="abc", served_model_name="m-prod")
    joined = " ".join(worker_argv(hub, cpu_plan, 0, "x:1"))
    assert "--model org/m" in joined and "--revision v2" in joined and "--draft-model org/d" in joined
    assert "--draft-revision abc" in joined and "--served-model-name m-prod" in joined
    assert "--num-draft-tokens" not in joined  # unset: each worker's own default
    assert "--num-draft-tokens 0" in " ".join(worker_argv(UpSettings(num_draft_tokens=0), cpu_plan, 0, "x:1"))
    assert "--num-draft-tokens 2" in " ".join(worker_argv(UpSettings(num_draft_tokens=2), cpu_plan, 0, "x:1"))
    assert "--stream-interval" not in joined  # unset: each worker's own default (1)
    assert "--stream-interval 4" in " ".join(worker_argv(UpSettings(stream_interval=4), cpu_plan, 0, "x:1"))


def test_router_processes_pass_through_and_shift_the_workers_metrics_ports():
    from services.launcher import UpSettings, router_argv, worker_argv

    one = UpSettings(metrics_base_port=9100)
    assert "--procs" not in router_argv(one, 50050, "x:1", 8000)
    assert " ".join(router_argv(one, 50050, "x:1", None)).endswith("--metrics-port 9101")
    three = UpSettings(metrics_base_port=9100, router_procs=3)
    joined = " ".join(router_argv(three, 50050, "x:1", 8000))
    assert "--http-port 8000 --procs 3 --metrics-port 9101" in joined  # router process j: 9101 + j
    cpu_plan = plan_workers(device="cpu", gpus=[], workers=2)[0][1]
    assert worker_argv(one, cpu_plan, 0, "x:1")[-2:] == ["--metrics-port", "9103"]  # the layout of one router process
    assert worker_argv(three, cpu_plan, 0, "x:1")[-2:] == ["--metrics-port", "9105"]  # after 9101..9103


@pytest.mark.parametrize("head_dim,backend", [(128, "flashinfer"), (64, "flashinfer"), (32, "torch"), (16, "torch")])
def test_a_head_size_without_flashinfer_kernels_runs_the_torch_backend_on_the_gpus(head_dim, backend):
    # tiny (16) and the first demo model (32) must still start on a GPU box
    plans, notes = plan_workers(device="auto", gpus=gpus(70, 70), head_dim=head_dim)
    assert {(p.device, p.backend, p.dtype) for p in plans} == {("cuda:0", backend, "bfloat16")}
    assert (backend == "torch") == any(f"head_dim {head_dim}" in n for n in notes)


def test_the_plan_and_the_backend_agree_on_flashinfer_head_sizes():
    from services.gpuworker.attention import flashinfer_backend  # imports no flashinfer until used
    from services.launch_plan import FLASHINFER_HEAD_DIMS

    assert tuple(flashinfer_backend._SUPPORTED_HEAD_DIMS) == FLASHINFER_HEAD_DIMS


def test_tandem_up_checks_the_demo_model_head_size():
    from services.launcher import UpSettings, check_model

    from services.gpuworker.model.loader import plan_model  # the launcher's own answer, from config alone
    from services.launch_plan import FLASHINFER_HEAD_DIMS

    head_dim = check_model(UpSettings())
    # the demo model's heads have FlashInfer kernels: a GPU box serves it with FlashInfer + graphs
    assert head_dim in FLASHINFER_HEAD_DIMS
    assert head_dim == plan_model(UpSettings().model).config.head_dim
    plans, notes = plan_workers(device="auto", gpus=gpus(70), head_dim=head_dim)
    assert [p.backend for p in plans] == ["flashinfer"] and not any("head_dim" in n for n in notes)


def test_tandem_up_refuses_a_k_its_workers_would_refuse_in_one_line():
    """``tandem up --num-draft-tokens`` goes to every worker; a combination the worker's own
    settings refuse is a configuration error of ``tandem up`` (its flags named), before anything
    starts — not a pydantic traceback, nor workers exiting and restarting."""
    from services.common.startup import EXIT_CONFIG, StartupError
    from services.launcher import UpSettings, check_model

    with pytest.raises(StartupError) as err:
        check_model(UpSettings(spec_mode="none", num_draft_tokens=3))
    assert err.value.exit_code == EXIT_CONFIG
    assert err.value.message == "invalid configuration: --num-draft-tokens above 0 needs a draft (--spec-mode eagle3 or mtp)"
    with pytest.raises(StartupError, match="exceeds --max-draft-tokens 8"):
        check_model(UpSettings(num_draft_tokens=9))  # above the workers' max_draft_tokens (8)
    assert check_model(UpSettings(num_draft_tokens=2)) == check_model(UpSettings())


def test_tandem_up_names_a_worker_setting_from_the_environment_by_its_variable(monkeypatch):
    """``check_model`` builds the workers' settings, which read ``TANDEM_WORKER_*`` from the
    environment (the workers inherit it): a bad one is named by that variable, not by a
    ``tandem up`` flag or ``TANDEM_UP_*`` variable that does not exist."""
    from services.common.startup import EXIT_CONFIG, StartupError
    from services.launcher import UpSettings, check_model

    monkeypatch.setenv("TANDEM_WORKER_MAX_DRAFT_TOKENS", "abc")
    with pytest.raises(StartupError) as err:
        check_model(UpSettings())
    assert err.value.exit_code == EXIT_CONFIG
    assert err.value.message.startswith("invalid configuration: TANDEM_WORKER_MAX_DRAFT_TOKENS (environment): ")
    assert "--max-draft-tokens" not in err.value.message and "TANDEM_UP_" not in err.value.message
    monkeypatch.setenv("TANDEM_WORKER_MAX_DRAFT_TOKENS", "12")  # the workers allow more: so does tandem up
    assert check_model(UpSettings(num_draft_tokens=10)) == check_model(UpSettings())
