# Open-Jev worker: one per GPU. CUDA runtime + torch + CuPy; the kernels in cuda/*.cu are
# compiled by CuPy (NVRTC) at start, so the image carries them as source.
#   docker build -f deploy/worker.Dockerfile -t openjev-worker .
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY pyproject.toml README.md ./
COPY common ./common
COPY frontend ./frontend
COPY worker ./worker
COPY tools ./tools
COPY cuda ./cuda
# torch from PyPI is the CUDA build on Linux; cupy-cuda12x compiles the RawModules (the kernels
# are package data, found through importlib.resources).
RUN pip install ".[cuda]" \
 && useradd --system --uid 10001 --create-home --home-dir /home/openjev openjev \
 && mkdir -p /var/lib/openjev/demo-model && chown 10001:10001 /var/lib/openjev/demo-model

# Non-root; the export is mounted read-only at /models/open-jev. CuPy's compiled-kernel cache
# goes to a writable tmp directory, never next to the model.
USER 10001:10001
ENV OPENJEV_MODEL=/models/open-jev \
    OPENJEV_LISTEN=0.0.0.0:50052 \
    OPENJEV_METRICS_PORT=9091 \
    CUPY_CACHE_DIR=/tmp/cupy-cache
EXPOSE 50052 9091
HEALTHCHECK --interval=5s --timeout=3s --start-period=300s --retries=3 \
  CMD ["python", "-m", "openjev.healthcheck", "127.0.0.1:50052"]
# The same entry the tests start (openjev.tools.launch.WORKER_MODULE); flags come from OPENJEV_* or CMD.
ENTRYPOINT ["python", "-m", "openjev.worker.main"]
CMD []
