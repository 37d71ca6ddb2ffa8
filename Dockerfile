# One image for all three services (the command picks one), in a virtual environment at /opt/venv.
#
#   docker build -t tandem .                                   # CPU (python:3.12-slim, CPU torch)
#   docker build -t tandem-gpu \                               # GPU workers: CUDA *devel* base, so
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04 \  # FlashInfer's JIT finds nvcc
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 --build-arg EXTRAS=gpu .
#
# BASE_IMAGE may be any Debian/Ubuntu image: without python3 it is installed with apt-get.
# Offline builds (scripts/compose-smoke.sh): wheels put in .whl/ by `pip wheel` are installed with
# --no-index, and no index is contacted at all.
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
RUN if ! command -v python3 >/dev/null || ! python3 -c "import venv, ensurepip" 2>/dev/null; then \
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY . /src
RUN if ls /src/.whl/*.whl >/dev/null 2>&1; then \
        pip install --no-index --find-links /src/.whl "tandem-serve${EXTRAS:+[$EXTRAS]}"; \
    else \
        pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
        && pip install "/src${EXTRAS:+[$EXTRAS]}"; \
    fi \
    && rm -rf /src
# Models live in a volume (compose mounts one at /models); the tiny built-in model needs none.
VOLUME ["/models"]
ENTRYPOINT ["tandem"]
