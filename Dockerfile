# Clairvoyant: the scheduling proxy, with the shipped predictor model inside.
#
# Two stages on one pinned base: `build` installs the package and its serving dependencies into a
# virtual environment; the runtime image receives only that environment (no pip cache, no sources, no
# training, benchmark or progress-bar dependencies: see pyproject.toml). The model is in it once, as
# the package's model/ files (package-data), where the proxy reads its predictor and encoder by default.
# Size, estimated and not measured (no Docker engine where this was written): the base image is about
# 125 MB uncompressed; the serving packages about 175 MB (onnxruntime 80 MB and numpy 71 MB of it,
# summed from the installed files of the same versions), the model 41 MB (the files package-data
# names, summed), plus about 15 MB of pip in the environment; so about 355 MB in all.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /build
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
# src/clairvoyant/model links to ../../model: the wheel takes the model files from here.
COPY model ./model
# Serving dependencies only: no extras (training, llama.cpp, tqdm).
RUN python -m venv /opt/clairvoyant && /opt/clairvoyant/bin/pip install .

FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/clairvoyant/bin:$PATH
COPY --from=build /opt/clairvoyant /opt/clairvoyant
RUN useradd --create-home --uid 10001 clairvoyant
WORKDIR /app

USER clairvoyant

# Listen on all interfaces inside the container; every setting is a CLAIRVOYANT_* variable. The
# predictor and the encoder are the package's own (model_path and encoder_path unset).
ENV CLAIRVOYANT_HOST=0.0.0.0 \
    CLAIRVOYANT_PORT=8080 \
    CLAIRVOYANT_UPSTREAM_URL=http://ollama:11434
EXPOSE 8080

# The slim image has no curl: probe /healthz with the standard library.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status == 200 else 1)"]

ENTRYPOINT ["clairvoyant", "serve"]
