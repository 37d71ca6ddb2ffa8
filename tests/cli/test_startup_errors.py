"""Every start-up mistake ends in ONE line on stderr and a documented exit code, never a
traceback: 2 = configuration (flags, TANDEM_* variables), 3 = environment (ports, model files)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tandem(*argv: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    full_env.update(PYTHONPATH=str(ROOT), TANDEM_HOME=str(ROOT / ".no-such-home"), **(env or {}))
    return subprocess.run([sys.executable, "-m", "services.cli", *argv], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The single ``error:`` line of stderr (log lines aside); fails on a traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("service", ["kvstore", "router"])
def test_grpc_port_in_use(service, busy_port):
    proc = tandem(service, "--port", str(busy_port), "--kvstore", f"127.0.0.1:{free_port()}") if service == "router" \
        else tandem(service, "--port", str(busy_port))
    assert proc.returncode == 3
    assert one_error_line(proc) == f"tandem {service}: error: port 127.0.0.1:{busy_port} is already in use (stop what holds it, or choose another port)"


def test_metrics_port_in_use(busy_port):
    proc = tandem("kvstore", "--port", "0", "--metrics-port", str(busy_port))
    assert proc.returncode == 3
    assert f"metrics port 127.0.0.1:{busy_port} is already in use" in one_error_line(proc)


def test_missing_model_folder_for_worker_and_router(tmp_path):
    missing = tmp_path / "no-model"
    worker = tandem("worker", "--model", str(missing), "--port", "0", "--kvstore", f"127.0.0.1:{free_port()}")
    assert worker.returncode == 3
    assert one_error_line(worker) == (f"tandem worker: error: cannot load model '{missing}': {missing} is neither "
                                      "a folder nor a hub id (org/name)")
    missing.mkdir()
    worker = tandem("worker", "--model", str(missing), "--port", "0", "--kvstore", f"127.0.0.1:{free_port()}")
    assert worker.returncode == 3
    assert one_error_line(worker) == f"tandem worker: error: cannot load model '{missing}': no config.json in {missing}"
    draft = tandem("worker", "--draft-model", str(missing), "--port", "0", "--kvstore", f"127.0.0.1:{free_port()}")
    assert draft.returncode == 3
    assert f"cannot load model 'tiny': no draft in {missing}" in one_error_line(draft)
    router = tandem("router", "--model", str(tmp_path / "nothing"), "--port", "0")
    assert router.returncode == 3
    assert f"cannot load the tokenizer of model '{tmp_path / 'nothing'}'" in one_error_line(router)


def _config_only(folder, layers):
    """A model folder with a config.json and NO weights: anything refused here was refused
    before a weight was read."""
    import json

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2}))
    return folder


@pytest.mark.parametrize("argv, message", [
    (["--backend", "flashinfer", "--device", "cuda:0", "--dtype", "float32"],
     "the flashinfer backend runs bfloat16 or float16, not float32"),
    (["--spec-mode", "none", "--draft-model", "random"], "--draft-model needs --spec-mode eagle3 or mtp"),
    (["--spec-mode", "eagle3", "--mtp-depth", "2"], "--mtp-depth 2 needs --spec-mode mtp"),
    (["--model", "{two_layers}", "--spec-mode", "eagle3", "--draft-model", "random"],
     "EAGLE-3 needs a target with at least 3 layers"),
    (["--model", "{four_layers}", "--spec-mode", "eagle3"], "has no EAGLE3 draft: give --draft-model"),
    (["--model", "{four_layers}", "--spec-mode", "mtp"], "has no MTP draft: give --draft-model"),
])
def test_impossible_combinations_are_refused_before_loading(tmp_path, argv, message):
    paths = {"two_layers": str(_config_only(tmp_path / "two", 2)), "four_layers": str(_config_only(tmp_path / "four", 4))}
    argv = [a.format(**paths) for a in argv]
    proc = tandem("worker", *argv, "--port", "0", "--kvstore", f"127.0.0.1:{free_port()}")
    assert proc.returncode == 2, proc.stderr
    assert message in one_error_line(proc)


def test_invalid_settings_are_one_line_with_flag_and_variable():
    proc = tandem("kvstore", "--port", "0", env={"TANDEM_KVSTORE_LEASE_TTL_S": "-1"})
    assert proc.returncode == 2
    assert one_error_line(proc) == ("tandem kvstore: error: invalid configuration: --lease-ttl-s / TANDEM_KVSTORE_LEASE_TTL_S: "
                                    "Input should be greater than 0 (got '-1')")


def test_kubernetes_service_link_collision_names_the_fix():
    proc = tandem("kvstore", env={"TANDEM_KVSTORE_PORT": "tcp://10.96.0.7:50051"})
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "TANDEM_KVSTORE_PORT='tcp://10.96.0.7:50051' looks like a Kubernetes service link" in line
    assert "enableServiceLinks: false" in line and "tandem-kvstore" in line


def test_enum_flag_lists_its_choices_and_rejects_others():
    helptext = tandem("worker", "--help").stdout
    assert "--spec-mode {none,eagle3,mtp}" in helptext and "--dtype {auto,float32,bfloat16,float16}" in helptext
    proc = tandem("worker", "--spec-mode", "medusa")
    assert proc.returncode == 2
    assert "argument --spec-mode: invalid choice: 'medusa' (choose from" in one_error_line(proc)


def test_generate_rejects_negative_max_new_tokens():
    proc = tandem("generate", "--max-tokens", "-5", "hi")
    assert proc.returncode == 2
    assert one_error_line(proc) == "tandem generate: error: argument --max-tokens/--max-new-tokens: must be >= 1 (got -5)"


def test_up_with_a_busy_port_refuses_before_starting_anything(busy_port):
    proc = tandem("up", "--device", "cpu", "--router-port", str(busy_port), "--kvstore-port", "0", "--worker-base-port", "0",
                  "--demo", "--exit-after-demo")
    assert proc.returncode == 3
    line = one_error_line(proc)
    assert line.startswith(f"tandem up: error: router port 127.0.0.1:{busy_port} is already in use")
    assert "another Tandem suite" in line
    assert "demo request" not in proc.stdout and "SERVING" not in proc.stdout


def test_version_and_global_flags_after_the_subcommand():
    from services.cli import build_parser

    assert tandem("--version").stdout.startswith("tandem ")
    assert tandem("kvstore", "--version").stdout == tandem("--version").stdout
    args = build_parser("generate").parse_args(["generate", "hi", "--log-level", "debug"])
    assert args.log_level == "DEBUG"
    assert build_parser("generate").parse_args(["--log-level", "error", "generate", "hi"]).log_level == "ERROR"
    assert build_parser("generate").parse_args(["generate", "hi"]).log_level == "INFO"


def test_tandem_up_refuses_a_model_without_the_draft_before_starting_anything():
    proc = tandem("up", "--spec-mode", "mtp", "--router-port", "0", "--kvstore-port", "0", "--worker-base-port", "0")
    assert proc.returncode == 2
    assert "cannot load model 'demo': demo has no MTP draft: give --draft-model" in one_error_line(proc)
    assert "starting kvstore" not in proc.stdout


def test_row14_secrets_are_never_printed_and_tokens_never_on_argv(tmp_path):
    """Issue 8 row 14: a settings error masks secret values; ``tandem generate`` takes its
    token from a file or TANDEM_TOKEN, and refuses a --token flag (argv is visible in ps)."""
    from services.client import read_token
    from services.common.settings import shown_value

    assert shown_value("tenants", "tok=alice") == "'***'" and shown_value("salt_secret", "s3cret") == "'***'"
    assert shown_value("max_new_tokens", 5) == "5"  # not a secret
    proc = tandem("router", "--tls-cert", "/no/such.crt", env={"TANDEM_ROUTER_TENANTS": "sekrit-token=alice"})
    assert proc.returncode == 2 and "sekrit" not in proc.stderr + proc.stdout
    proc = tandem("generate", "--token", "sekrit-token", "hello")
    assert proc.returncode == 2 and "--token is not accepted" in proc.stderr and "sekrit" not in proc.stderr
    token = tmp_path / "token"
    token.write_text("file-token\n")
    assert read_token(str(token), environ={}) == "file-token"
    assert read_token("", environ={"TANDEM_TOKEN": "env-token"}) == "env-token"
    assert read_token("", environ={}) is None


def test_tls_flags_go_together():
    proc = tandem("kvstore", "--tls-cert", "a.crt")
    assert proc.returncode == 2 and "tls_cert, tls_key and tls_ca go together" in one_error_line(proc)
