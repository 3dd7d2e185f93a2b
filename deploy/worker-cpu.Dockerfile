# Open-Jev worker without a GPU: the PyTorch CPU path (the compose `cpu` profile, CI, laptops).
#   docker build -f deploy/worker-cpu.Dockerfile -t openjev-worker-cpu .
# torch is the CPU build: from the PyTorch CPU index by default (PyPI's Linux torch is the CUDA
# build, several GB), or from a directory of wheels (TORCH_FIND_LINKS, an http:// URL or path).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
RUN if [ -n "$TORCH_FIND_LINKS" ]; then \
      pip install --no-deps --no-index --find-links "$TORCH_FIND_LINKS" "torch==2.13.0"; \
    else \
      pip install --no-deps --index-url "$TORCH_INDEX_URL" "torch==2.13.0"; \
    fi
# The sources the distribution installs, in one layer (.dockerignore admits only those).
COPY . ./
# torch's own dependencies and the rest come from PyPI; the torch above already satisfies the pin.
RUN pip install ".[worker,tracing]" \
 && useradd --system --uid 10001 --create-home --home-dir /home/openjev openjev \
 && mkdir -p /var/lib/openjev && chown 10001:10001 /var/lib/openjev

USER 10001:10001
ENV OPENJEV_MODEL=/models/open-jev \
    OPENJEV_LISTEN=0.0.0.0:50052 \
    OPENJEV_METRICS_PORT=9091 \
    OPENJEV_BACKEND=torch
EXPOSE 50052 9091
HEALTHCHECK --interval=5s --timeout=3s --start-period=120s --retries=3 \
  CMD ["python", "-m", "openjev.healthcheck", "127.0.0.1:50052"]
ENTRYPOINT ["python", "-m", "openjev.worker.main"]
CMD []
