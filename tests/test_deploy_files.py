"""Dockerfile and docker-compose.yml, checked statically (no Docker engine runs here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from clairvoyant.config import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[1]
SETTING_ENVS = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile_is_slim_non_root_with_model_healthcheck_and_documented_entrypoint() -> None:
    instructions = dockerfile_instructions()
    keywords = [k for k, _ in instructions]
    args = {k: [a for kk, a in instructions if kk == k] for k in keywords}
    assert re.fullmatch(r"python:3\.11-slim\S*", args["FROM"][0])
    user = args["USER"][-1]
    assert user not in ("root", "0")
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")
    assert any("model" in a.split()[0] for a in args["COPY"])  # the shipped model is inside
    assert (ROOT / "model" / "predictor.onnx").is_file() and (ROOT / "model" / "predictor.card.json").is_file()
    env = " ".join(args["ENV"])
    assert "CLAIRVOYANT_HOST=0.0.0.0" in env and "CLAIRVOYANT_PORT=8080" in env
    assert "CLAIRVOYANT_MODEL_PATH=/app/model/predictor.onnx" in env
    assert set(re.findall(r"(CLAIRVOYANT_[A-Z_]+)=", env)) <= SETTING_ENVS
    assert args["EXPOSE"] == ["8080"]
    assert "/healthz" in args["HEALTHCHECK"][0] and "curl" not in args["HEALTHCHECK"][0]
    entrypoint = json.loads(args["ENTRYPOINT"][0])
    assert entrypoint == ["clairvoyant", "serve"]
    assert "clairvoyant serve" in (ROOT / "README.md").read_text()


def test_compose_wires_clairvoyant_to_a_healthy_serial_ollama() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    ollama, proxy = services["ollama"], services["clairvoyant"]
    assert ollama["image"].startswith("ollama/ollama")
    assert str(ollama["environment"]["OLLAMA_NUM_PARALLEL"]) == "1"
    volume = ollama["volumes"][0].split(":")
    assert volume[1] == "/root/.ollama" and volume[0] in compose["volumes"]
    assert ollama["healthcheck"]["test"] == ["CMD", "ollama", "list"]
    assert proxy["depends_on"]["ollama"]["condition"] == "service_healthy"
    assert proxy["environment"]["CLAIRVOYANT_UPSTREAM_URL"] == "http://ollama:11434"
    assert set(proxy["environment"]) <= SETTING_ENVS
    assert str(proxy["environment"]["CLAIRVOYANT_SLOTS"]) == str(ollama["environment"]["OLLAMA_NUM_PARALLEL"])
    assert "8080:8080" in proxy["ports"]
    assert proxy["build"] == "."


def test_the_package_carries_the_shipped_model() -> None:
    """src/clairvoyant/model links to model/ and package-data names its files, so a wheel (and the
    Docker image's `pip install .`) carries the model the predictor loads by default."""
    import tomllib

    from clairvoyant.prediction.predictor import DEFAULT_MODEL_PATH

    link = ROOT / "src" / "clairvoyant" / "model"
    assert link.is_symlink() and link.resolve() == (ROOT / "model").resolve()
    assert DEFAULT_MODEL_PATH.resolve() == (ROOT / "model" / "predictor.onnx").resolve()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert {"model/predictor.onnx", "model/predictor.card.json"} <= set(package_data["clairvoyant"])
