# A Debian image with a few Debian packages installed: the smoke script builds Redis and
# Prometheus this way because no image registry is reachable there (users pull the official images).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ARG PACKAGES
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${PACKAGES} \
    && rm -rf /var/lib/apt/lists/*
