# kvserve image: `docker build -t kvserve .` (CPU torch) or `--build-arg TORCH_VARIANT=cuda`.
# The build stage installs with scripts/install.sh, the same script README and CI use, and bakes
# the bundled default model (converted once from GGUF) into the image's cache directory.

FROM python:3.11-slim AS build

# cpu: torch from the PyTorch CPU wheel index (small); cuda: the default PyPI torch (CUDA-enabled).
ARG TORCH_VARIANT=cpu
# Extras passed to scripts/install.sh (empty: runtime dependencies only).
ARG KVSERVE_EXTRAS=""

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVSERVE_VENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    KVSERVE_CACHE_DIR=/var/cache/kvserve \
    HF_HUB_OFFLINE=1

WORKDIR /app

# Everything scripts/install.sh needs for an editable install of kvserve.
COPY pyproject.toml README.md ./
COPY scripts/ scripts/
COPY engine/ engine/
COPY server/ server/

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN case "$TORCH_VARIANT" in \
        cpu) export KVSERVE_TORCH_INDEX=https://download.pytorch.org/whl/cpu ;; \
        cuda) unset KVSERVE_TORCH_INDEX ;; \
        *) echo "TORCH_VARIANT must be cpu or cuda, got '$TORCH_VARIANT'" >&2; exit 1 ;; \
    esac \
    && scripts/install.sh "$KVSERVE_EXTRAS" \
    && python -c "from engine.models.loader import resolve_model; print(resolve_model(None))"


FROM python:3.11-slim AS runtime

LABEL org.opencontainers.image.title="kvserve" \
      org.opencontainers.image.description="OpenAI-compatible LLM server with a paged KV cache" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    KVSERVE_CACHE_DIR=/var/cache/kvserve \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

RUN useradd --create-home --no-log-init --uid 10001 --user-group kvserve \
    && mkdir -p /models \
    && chown kvserve:kvserve /models

# Same paths as in the build stage: the venv's editable install points at /app.
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
COPY --from=build --chown=kvserve:kvserve /var/cache/kvserve /var/cache/kvserve

WORKDIR /app
USER 10001:10001
EXPOSE 8000

HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

CMD ["kvserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
