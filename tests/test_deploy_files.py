"""Dockerfile and docker-compose.yml, checked statically (no Docker engine runs here)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePosixPath

import yaml

from clairvoyant.config import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[1]
SETTING_ENVS = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, with global ARG defaults substituted into FROM lines."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    args: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            keyword, rest = keyword.upper(), rest.strip()
            if keyword == "ARG" and "=" in rest and not any(k == "FROM" for k, _ in out):
                name, _, value = rest.partition("=")
                args[name] = value
            if keyword == "FROM":
                rest = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest)
            out.append((keyword, rest))
    return out


# An exact image tag: a version with at least major.minor.patch, never "latest" or a floating minor.
EXACT_TAG = re.compile(r"[\w./-]+:v?\d+\.\d+\.\d+[\w.-]*")


def test_dockerfile_is_slim_non_root_with_model_healthcheck_and_documented_entrypoint() -> None:
    instructions = dockerfile_instructions()
    keywords = [k for k, _ in instructions]
    args = {k: [a for kk, a in instructions if kk == k] for k in keywords}
    # Every stage on one base pinned to an exact Python release (the runtime stage is the last FROM).
    bases = {a.split()[0] for a in args["FROM"]}
    assert len(bases) == 1
    (base,) = bases
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", base), base
    assert len(args["FROM"]) == 2 and args["FROM"][-1].endswith("AS runtime")
    # The runtime stage receives the built environment, not the sources or a compiler.
    runtime = max(i for i, k in enumerate(keywords) if k == "FROM")
    runtime_copies = [a for k, a in instructions[runtime:] if k == "COPY"]
    assert any(a.startswith("--from=build ") for a in runtime_copies)
    assert not any(a.split()[0] in ("src", ".", "pyproject.toml") for a in runtime_copies)
    user = args["USER"][-1]
    assert user not in ("root", "0")
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")
    assert (ROOT / "model" / "predictor.onnx").is_file() and (ROOT / "model" / "predictor.card.json").is_file()
    env = " ".join(args["ENV"])
    assert "CLAIRVOYANT_HOST=0.0.0.0" in env and "CLAIRVOYANT_PORT=8080" in env
    assert set(re.findall(r"(CLAIRVOYANT_[A-Z_]+)=", env)) <= SETTING_ENVS
    assert args["EXPOSE"] == ["8080"]
    assert "/healthz" in args["HEALTHCHECK"][0] and "curl" not in args["HEALTHCHECK"][0]
    entrypoint = json.loads(args["ENTRYPOINT"][0])
    assert entrypoint == ["clairvoyant", "serve"]
    assert "clairvoyant serve" in (ROOT / "README.md").read_text()


def test_the_image_holds_the_model_once_inside_the_package() -> None:
    """The build stage puts model/ where the package's link points, so `pip install .` puts the model
    files in the environment (package-data); the runtime stage takes only the environment, and no
    setting points the proxy at another copy."""
    instructions = dockerfile_instructions()
    starts = [i for i, (k, _) in enumerate(instructions) if k == "FROM"]
    build, runtime = instructions[starts[0] : starts[1]], instructions[starts[1] :]
    workdir = PurePosixPath(next(a for k, a in build if k == "WORKDIR"))
    copied = {
        workdir / a.split()[-1]: a.split()[0] for k, a in build if k == "COPY" and not a.startswith("--from")
    }  # destination in the build stage -> source in the context
    link = ROOT / "src" / "clairvoyant" / "model"
    target = PurePosixPath(os.path.normpath(workdir / "src" / "clairvoyant" / os.readlink(link)))
    assert copied.get(workdir / "src") == "src" and copied.get(target) == "model", copied
    # The runtime stage: the environment from the build stage, nothing from the context or elsewhere.
    runtime_copies = [a.split() for k, a in runtime if k == "COPY"]
    assert runtime_copies and all(
        words[0] == "--from=build" and all(PurePosixPath(w).is_relative_to("/opt/clairvoyant") for w in words[1:-1])
        for words in runtime_copies
    ), runtime_copies
    assert all(k != "ADD" for k, _ in runtime)
    env = " ".join(a for k, a in instructions if k == "ENV")
    assert "CLAIRVOYANT_MODEL_PATH" not in env and "CLAIRVOYANT_ENCODER_PATH" not in env


def test_compose_wires_clairvoyant_to_a_healthy_serial_ollama() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    ollama, proxy = services["ollama"], services["clairvoyant"]
    assert ollama["image"].startswith("ollama/ollama:") and EXACT_TAG.fullmatch(ollama["image"])
    assert str(ollama["environment"]["OLLAMA_NUM_PARALLEL"]) == "1"
    volume = ollama["volumes"][0].split(":")
    assert volume[1] == "/root/.ollama" and volume[0] in compose["volumes"]
    assert ollama["healthcheck"]["test"] == ["CMD", "ollama", "list"]
    assert proxy["depends_on"]["ollama"]["condition"] == "service_healthy"
    assert proxy["environment"]["CLAIRVOYANT_UPSTREAM_URL"] == "http://ollama:11434"
    assert set(proxy["environment"]) <= SETTING_ENVS
    assert str(proxy["environment"]["CLAIRVOYANT_SLOTS"]) == str(ollama["environment"]["OLLAMA_NUM_PARALLEL"])
    assert proxy["ports"] == ["127.0.0.1:8080:8080"]  # loopback only unless the user changes it
    assert all(port.startswith("127.0.0.1:") for svc in compose["services"].values() for port in svc.get("ports", []))
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
    from clairvoyant.prediction.encoder import DEFAULT_ENCODER_CARD

    card = json.loads(DEFAULT_ENCODER_CARD.read_text())
    encoder_files = {"model/encoder.card.json", f"model/{card['onnx_file']}", f"model/{card['tokenizer_file']}"}
    assert encoder_files <= set(package_data["clairvoyant"])
    assert DEFAULT_ENCODER_CARD.resolve() == (ROOT / "model" / "encoder.card.json").resolve()


def test_every_compose_image_is_pinned_and_every_mounted_file_exists() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        if "image" in service and "build" not in service:
            assert EXACT_TAG.fullmatch(service["image"]), f"{name}: {service['image']} is not an exact tag"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):  # a bind mount: the file or directory must be in the repository
                assert (ROOT / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in compose["volumes"], f"{name}: named volume {source} not declared"
    # The monitoring profile: Prometheus scrapes the proxy, Grafana gets the data source and dashboard.
    prometheus, grafana = compose["services"]["prometheus"], compose["services"]["grafana"]
    assert prometheus["profiles"] == ["monitoring"] and grafana["profiles"] == ["monitoring"]
    assert "profiles" not in compose["services"]["clairvoyant"]  # the default `up` still starts the proxy
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics" and scrape["static_configs"][0]["targets"] == ["clairvoyant:8080"]
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/clairvoyant.yml").read_text())
    dashboards_dir = provider["providers"][0]["options"]["path"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    assert mounted[f"{dashboards_dir}/clairvoyant.json"] == "./deploy/grafana/clairvoyant.json"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home in mounted


def flag_values(command: list[str]) -> dict[str, str]:
    """``--flag value`` pairs of a service's command (its arguments to ``clairvoyant serve``)."""
    assert len(command) % 2 == 0 and all(word.startswith("--") for word in command[::2]), command
    return dict(zip(command[::2], command[1::2], strict=True))


def test_the_replicas_profile_starts_redis_and_two_replicas_of_one_cluster_in_front_of_ollama() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    in_profile = {name for name, service in services.items() if "replicas" in service.get("profiles", [])}
    assert in_profile == {"redis", "clairvoyant-a", "clairvoyant-b"}
    assert "profiles" not in services["ollama"]  # started with the profile too
    redis = services["redis"]
    assert redis["image"].startswith("redis:") and EXACT_TAG.fullmatch(redis["image"])
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert "ports" not in redis  # only the replicas reach it
    replicas = [services["clairvoyant-a"], services["clairvoyant-b"]]
    flags = [flag_values(replica["command"]) for replica in replicas]
    assert {f["--redis"] for f in flags} == {"redis://redis:6379/0"}  # the redis service, on its default port
    assert len({f["--cluster"] for f in flags}) == 1  # one cluster: one queue and one set of slots
    assert len({f["--replica-id"] for f in flags}) == 2
    for replica in replicas:
        assert replica["build"] == "." and replica["image"] == services["clairvoyant"]["image"]
        assert replica["depends_on"]["redis"]["condition"] == "service_healthy"
        assert replica["depends_on"]["ollama"]["condition"] == "service_healthy"
        assert replica["environment"]["CLAIRVOYANT_UPSTREAM_URL"] == "http://ollama:11434"
        assert set(replica["environment"]) <= SETTING_ENVS
        assert str(replica["environment"]["CLAIRVOYANT_SLOTS"]) == str(
            services["ollama"]["environment"]["OLLAMA_NUM_PARALLEL"]
        )
    published = [port for replica in replicas for port in replica["ports"]]
    assert len({port.split(":")[1] for port in published}) == 2  # one host port each
    assert all(port.startswith("127.0.0.1:") for port in published)


def test_dockerignore_keeps_the_context_to_what_the_image_needs() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for excluded in (".venv", ".git", "results", "build", "tests", "benchmarks", "profiler/data", "**/__pycache__"):
        assert excluded in lines, excluded
    assert lines.index("**/*.onnx") < lines.index("!model/*.onnx")  # ONNX files only from model/
    # Nothing the Dockerfile copies from the context is ignored.
    sources = [
        w for k, a in dockerfile_instructions() if k == "COPY" and not a.startswith("--from") for w in a.split()[:-1]
    ]
    assert {"src", "model", "pyproject.toml", "README.md", "LICENSE"} <= set(sources)
    for path in sources:
        assert (ROOT / path).exists(), path
        assert path not in lines and f"{path}/" not in lines, path


def test_licence_and_project_metadata() -> None:
    import tomllib

    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert "END OF TERMS AND CONDITIONS" in licence
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert project["urls"] and all(u.startswith("https://") for u in project["urls"].values())


def test_serving_needs_no_progress_bar_package(tmp_path: Path) -> None:
    """tqdm is an extra, not a core dependency; the serve path and the simulator run with it absent."""
    import subprocess
    import sys
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not any(d.startswith("tqdm") for d in pyproject["project"]["dependencies"])
    extras = pyproject["project"]["optional-dependencies"]
    assert all(any(d.startswith("tqdm") for d in extras[e]) for e in ("tools", "train", "backend"))
    # Block tqdm as if it were not installed, then import the serving path and run a small simulation.
    code = (
        "import sys; sys.modules['tqdm'] = None\n"
        "import clairvoyant.proxy.app, clairvoyant.proxy.serve\n"
        "from clairvoyant.cli import main\n"
        "sys.exit(main(['simulate', 'run', '--n', '40', '--seeds', '1', '--conditions', 'fcfs', 'sjf',\n"
        f"               '--no-plots', '--out', {str(tmp_path)!r}]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "SJF" in (tmp_path / "sim_run.md").read_text() and "tqdm" not in result.stderr


def test_the_systemd_unit_runs_serve_as_a_dynamic_user_with_an_environment_file() -> None:
    unit: dict[str, dict[str, str]] = {}
    section = ""
    for line in (ROOT / "deploy" / "clairvoyant.service").read_text().splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            unit[section] = {}
        elif line and not line.startswith("#"):
            key, _, value = line.partition("=")
            unit[section][key] = value
    service = unit["Service"]
    program, *arguments = service["ExecStart"].split()
    assert Path(program).name == "clairvoyant" and arguments == ["serve"]
    assert service["DynamicUser"] == "yes" and service["Restart"] == "on-failure"
    assert service["RestartPreventExitStatus"] == "2"  # clairvoyant's exit status for a configuration error
    assert service["EnvironmentFile"].lstrip("-") == "/etc/clairvoyant/clairvoyant.env"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    # The example environment file sets only real settings, and keeps state in the unit's StateDirectory.
    env = dict(
        line.split("=", 1)
        for line in (ROOT / "deploy" / "clairvoyant.env").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert set(env) <= SETTING_ENVS
    assert env["CLAIRVOYANT_LEARNER_STATE_PATH"].startswith(f"/var/lib/{service['StateDirectory']}/")


def _deploy_texts() -> dict[str, str]:
    files = [ROOT / "docker-compose.yml", ROOT / "Dockerfile", *sorted((ROOT / "configs").glob("*.toml"))]
    files += [p for p in sorted((ROOT / "deploy").rglob("*")) if p.is_file()]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def test_the_deployment_files_point_to_docs_that_exist_and_name_the_server_they_run() -> None:
    """Their comments name docs/*.md pages and sections that exist (the README keeps only a few
    screens; a section it lost is a dead pointer), and never the server the proxy no longer runs."""
    pointers = 0
    for name, text in _deploy_texts().items():
        assert "uvicorn" not in text.lower(), name
        assert not re.search(r"README[,'’ ]", text), f"{name} points into the README"
        for page, section in re.findall(r"(docs/[a-z-]+\.md)(?:, [\"']([^\"']+)[\"'])?", text):
            assert (ROOT / page).is_file(), (name, page)
            if section:
                headings = re.findall(r"^#+ (.+)$", (ROOT / page).read_text(), re.M)
                assert section in headings, (name, page, section)
            pointers += 1
    assert pointers >= 5
