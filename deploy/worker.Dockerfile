# Open-Jev worker: one per GPU. torch, CuPy and CUDA's user-space libraries all come from PyPI
# wheels (PyPI's Linux torch 2.13 is the CUDA 13 build; its nvidia-* wheels, plus NVRTC, the
# runtime and crt headers through the cuda extra); the driver (libcuda) is the host's, mounted by
# the NVIDIA container toolkit. CuPy compiles the kernels (cuda/*.cu, package data) with NVRTC at
# start; the build already compiles each once without a GPU (offline_compile), so an image that
# could not compile them is never built. About 2.8 GB of wheels, 5.5 GB image: docs/deploy.md.
#   docker build -f deploy/worker.Dockerfile -t openjev-worker .
# BASE_IMAGE: any image with Python >= 3.11 as `python` and pip, no CUDA needed (where no registry
# is reachable, deploy/base-image/build.sh makes one from Debian's packages).
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
# The sources the distribution installs, in one layer (.dockerignore admits only those).
COPY . ./
# One layer: Docker's vfs storage driver copies the whole filesystem for every layer.
RUN pip install ".[cuda,tracing]" \
 && rm -rf /app/* \
 && cd / && python -m openjev.worker.cuda.offline_compile \
 && useradd --system --uid 10001 --create-home --home-dir /home/openjev openjev

# Non-root; the export is mounted read-only at /models/open-jev. CuPy's compiled-kernel cache
# goes to a writable tmp directory, never next to the model.
USER 10001:10001
ENV OPENJEV_MODEL=/models/open-jev \
    OPENJEV_LISTEN=0.0.0.0:50052 \
    OPENJEV_METRICS_PORT=9091 \
    CUPY_CACHE_DIR=/tmp/cupy-cache
EXPOSE 50052 9091
HEALTHCHECK --interval=5s --timeout=3s --start-period=600s --retries=3 \
  CMD ["python", "-m", "openjev.healthcheck", "127.0.0.1:50052"]
# The same entry the tests start (openjev.tools.launch.WORKER_MODULE); flags come from OPENJEV_* or CMD.
ENTRYPOINT ["python", "-m", "openjev.worker.main"]
CMD []
