# One image for all three services (the command picks one). CPU by default; for GPU workers build
# with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 --build-arg EXTRAS=gpu.
FROM python:3.12-slim
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
WORKDIR /app
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY services ./services
COPY tandem ./tandem
RUN pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}"
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["tandem"]
