# Open-Jev frontend: CPU only, slim. It validates, renders and tokenizes; it never loads weights,
# so it is the base install (no extras): no torch, numpy or safetensors.
#   docker build -f deploy/frontend.Dockerfile -t openjev-frontend .
# BASE_IMAGE: any image with Python >= 3.11 as `python` and pip (where no registry is reachable,
# deploy/base-image/build.sh makes one from Debian's packages).
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
# The sources the distribution installs, in one layer (.dockerignore admits only those).
COPY . ./
RUN pip install ".[tracing]" \
 && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)" \
 && rm -rf /app/* \
 && useradd --system --uid 10001 --no-create-home openjev

# Non-root; the model directory (tokenizer and metadata only) is mounted read-only at /models/open-jev.
USER 10001:10001
ENV OPENJEV_MODEL=/models/open-jev \
    OPENJEV_LISTEN=0.0.0.0:50051 \
    OPENJEV_HTTP_LISTEN=0.0.0.0:8080 \
    OPENJEV_METRICS_PORT=9090
EXPOSE 50051 8080 9090
HEALTHCHECK --interval=5s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-m", "openjev.healthcheck", "127.0.0.1:50051"]
# The same entry the tests start (openjev.tools.launch.FRONTEND_MODULE); flags come from OPENJEV_* or CMD.
ENTRYPOINT ["python", "-m", "openjev.frontend.main"]
CMD []
