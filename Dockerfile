# Clairvoyant: the scheduling proxy, with the shipped predictor model inside.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
COPY model ./model
# Serving dependencies only: no training extras, no llama.cpp.
RUN pip install . && useradd --create-home --uid 10001 clairvoyant

USER clairvoyant

# Listen on all interfaces inside the container; every setting is a CLAIRVOYANT_* variable.
ENV CLAIRVOYANT_HOST=0.0.0.0 \
    CLAIRVOYANT_PORT=8080 \
    CLAIRVOYANT_MODEL_PATH=/app/model/predictor.onnx \
    CLAIRVOYANT_UPSTREAM_URL=http://ollama:11434
EXPOSE 8080

# The slim image has no curl: probe /healthz with the standard library.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status == 200 else 1)"]

ENTRYPOINT ["clairvoyant", "serve"]
