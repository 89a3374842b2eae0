"""Settings: precedence, validation naming the setting, config files, the generated settings table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clairvoyant.config import CLI_FLAGS, Settings, load_settings
from clairvoyant.errors import ConfigError
from clairvoyant.tools import settings_table
from clairvoyant.tools.settings_table import END_MARK, START_MARK, settings_reference_markdown, with_settings_table

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_match_the_paper_and_the_issue() -> None:
    s = load_settings()
    assert (s.host, s.port, s.upstream_url) == ("127.0.0.1", 8080, "http://127.0.0.1:11434")
    assert (s.starvation_timeout_s, s.starvation_slowdown, s.slots, s.max_queue, s.policy) == (1.0, 2.56, 1, 256, "sjf")
    assert s.starvation_slowdown_adaptive
    assert (s.min_priority, s.max_priority, s.fair_share, s.tenant_header) == (0, 10, True, "X-Clairvoyant-Tenant")
    assert s.read_timeout_s is None and not s.log_prompts and not s.allow_oracle


def test_flags_override_environment_which_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "c.toml"
    config.write_text('port = 9001\nslots = 3\nmax_queue = 7\nupstream_url = "http://file:1"\n')
    monkeypatch.setenv("CLAIRVOYANT_SLOTS", "4")
    monkeypatch.setenv("CLAIRVOYANT_UPSTREAM_URL", "http://env:2/")
    s = load_settings(config, port=9002, upstream_url=None)
    assert s.port == 9002  # flag beats file
    assert s.slots == 4  # environment beats file
    assert s.max_queue == 7  # file beats default
    assert s.upstream_url == "http://env:2"  # environment beats file; trailing slash normalised


def test_config_file_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "c.toml"
    config.write_text('policy = "fcfs"\n')
    monkeypatch.setenv("CLAIRVOYANT_CONFIG", str(config))
    assert load_settings().policy == "fcfs"


@pytest.mark.parametrize(
    ("env", "value", "named"),
    [
        ("CLAIRVOYANT_STARVATION_TIMEOUT_S", "-1", "starvation_timeout_s (CLAIRVOYANT_STARVATION_TIMEOUT_S)"),
        ("CLAIRVOYANT_SLOTS", "zero", "slots (CLAIRVOYANT_SLOTS)"),
        ("CLAIRVOYANT_POLICY", "lifo", "policy (CLAIRVOYANT_POLICY)"),
        ("CLAIRVOYANT_UPSTREAM_URL", "localhost:11434", "upstream_url (CLAIRVOYANT_UPSTREAM_URL)"),
        ("CLAIRVOYANT_PORT", "70000", "port (CLAIRVOYANT_PORT)"),
        ("CLAIRVOYANT_MODEL_SWITCH_BOUND_S", "inf", "model_switch_bound_s (CLAIRVOYANT_MODEL_SWITCH_BOUND_S)"),
        ("CLAIRVOYANT_MODEL_SWITCH_BOUND_S", "-5", "model_switch_bound_s (CLAIRVOYANT_MODEL_SWITCH_BOUND_S)"),
    ],
)
def test_an_invalid_value_is_refused_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, named: str
) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert f"invalid setting {named}" in str(info.value)


def test_bad_config_files_are_refused(tmp_path: Path) -> None:
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("prot = 1\n")
    with pytest.raises(ConfigError, match="unknown setting.*prot"):
        load_settings(unknown)
    broken = tmp_path / "broken.toml"
    broken.write_text("port = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(broken)
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "missing.toml")


@pytest.mark.parametrize("name", ["ollama.toml", "llamacpp.toml"])
def test_example_configs_are_valid(name: str) -> None:
    s = load_settings(ROOT / "configs" / name)
    assert s.slots == 1 and s.policy == "sjf"
    assert s.upstream_url.startswith("http://127.0.0.1:")


@pytest.mark.e2e  # the `clairvoyant` command, run as a process
def test_serve_refuses_an_invalid_setting_before_starting() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "clairvoyant", "serve", "--tau", "-5"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "invalid setting starvation_timeout_s" in result.stderr


@pytest.mark.e2e  # the `clairvoyant` command, run as a process
def test_serve_refuses_a_missing_model_before_starting(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "clairvoyant", "serve", "--predictor", str(tmp_path / "nope.onnx")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "nope.onnx" in result.stderr and "not found" in result.stderr


def test_the_configuration_page_is_generated_from_the_settings() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert with_settings_table(page) == page  # `make settings-table` would change nothing
    assert all(f"`{name}`" in settings_reference_markdown() for name in Settings.model_fields)


def test_settings_table_rewrites_only_between_the_markers(tmp_path: Path) -> None:
    page = tmp_path / "configuration.md"
    page.write_text(f"# Settings\n{START_MARK} generated -->\n| stale |\n{END_MARK}\nafter\n")
    assert settings_table.main([str(page)]) == 0
    text = page.read_text()
    assert "| stale |" not in text
    assert text.startswith(f"# Settings\n{START_MARK} generated -->\n" + settings_reference_markdown())
    assert text.endswith(f"{END_MARK}\nafter\n")


def test_the_service_time_state_lives_beside_the_learners_unless_set() -> None:
    from pathlib import Path

    from clairvoyant.config import Settings

    assert Settings().service_time_path is None
    beside = Settings(learner_state_path=Path("/var/lib/cv/learner.npz"))
    assert beside.service_time_path == Path("/var/lib/cv/learner.service-time.json")
    own = Settings(learner_state_path=Path("/var/lib/cv/learner.npz"), service_time_state=Path("/tmp/s.json"))
    assert own.service_time_path == Path("/tmp/s.json")


def test_an_unknown_environment_variable_is_a_warning_naming_the_closest_valid_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CLAIRVOYANT_POLCY", "fcfs")
    monkeypatch.setenv("CLAIRVOYANT_ZZZ_NOTHING_LIKE_IT", "1")
    monkeypatch.setenv("CLAIRVOYANT_SLOTS", "2")  # a valid one is not reported
    with caplog.at_level("WARNING", logger="clairvoyant.config"):
        s = load_settings()
    assert s.policy == "sjf" and s.slots == 2  # started anyway; the typo changed nothing
    messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("CLAIRVOYANT_POLCY" in m and "did you mean CLAIRVOYANT_POLICY?" in m for m in messages)
    assert any("CLAIRVOYANT_ZZZ_NOTHING_LIKE_IT" in m and "did you mean" not in m for m in messages)
    assert not any("CLAIRVOYANT_SLOTS" in m for m in messages)


def test_unknown_environment_variables_ignore_the_other_names_read_on_purpose() -> None:
    from clairvoyant.config import unknown_environment_variables

    environ = {
        "CLAIRVOYANT_CONFIG": "x.toml",
        "CLAIRVOYANT_REQUIRE_BACKEND": "1",
        "HOME": "/root",
        "CLAIRVOYANT_STARVATION_TIMEOUT": "5",
    }
    assert unknown_environment_variables(environ) == [
        "unknown environment variable CLAIRVOYANT_STARVATION_TIMEOUT (ignored); "
        "did you mean CLAIRVOYANT_STARVATION_TIMEOUT_S?"
    ]


@pytest.mark.e2e  # the `clairvoyant` command, run as a process
def test_serve_warns_about_an_unknown_variable_and_goes_on_to_the_next_check(tmp_path: Path) -> None:
    """The warning is printed (formatted) and start-up continues: here it then stops at the missing model."""
    import os

    env = {**os.environ, "CLAIRVOYANT_POLCY": "fcfs"}
    result = subprocess.run(
        [sys.executable, "-m", "clairvoyant", "serve", "--predictor", str(tmp_path / "nope.onnx")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert "WARNING clairvoyant.config: unknown environment variable CLAIRVOYANT_POLCY" in result.stderr
    assert "did you mean CLAIRVOYANT_POLICY?" in result.stderr
    assert result.returncode == 2 and "nope.onnx" in result.stderr


def test_an_unknown_config_key_names_the_file_the_key_and_the_closest_valid_key(tmp_path: Path) -> None:
    config = tmp_path / "typo.toml"
    config.write_text("starvation_timeout = 5\nslots = 1\n")
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    message = str(info.value)
    assert str(config) in message
    assert "unknown setting 'starvation_timeout'" in message
    assert "did you mean starvation_timeout_s?" in message


def test_a_bad_value_in_the_config_file_is_blamed_on_the_file_and_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("slots = 0\n")
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    message = str(info.value)
    assert f"invalid setting slots (config file {config}, key slots)" in message
    assert "CLAIRVOYANT_SLOTS" not in message
    # The same bad value from the environment is blamed on the variable, and a flag on the flag.
    monkeypatch.setenv("CLAIRVOYANT_SLOTS", "0")
    with pytest.raises(ConfigError, match=r"invalid setting slots \(CLAIRVOYANT_SLOTS\)"):
        load_settings(config)
    with pytest.raises(ConfigError, match=r"invalid setting slots \(flag --slots\)"):
        load_settings(config, slots=0)


def test_a_pool_of_backends_from_a_file_the_environment_or_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "pool.toml"
    config.write_text(
        '[[backends]]\nurl = "http://gpu:11434/"\nkind = "ollama"\nmodels = ["llama3"]\n\n'
        '[[backends]]\nurl = "http://laptop:8080"\nname = "laptop"\nslots = 2\napi_key = "sk-backend"\n'
    )
    s = load_settings(config)
    assert [(b.name, b.url, b.kind, b.slots, b.models) for b in s.pool] == [
        ("backend-1", "http://gpu:11434", "ollama", None, ["llama3"]),
        ("laptop", "http://laptop:8080", "auto", 2, []),
    ]
    assert "sk-backend" not in repr(s.pool)  # a secret, never printed
    monkeypatch.setenv("CLAIRVOYANT_BACKENDS", '[{"url": "http://env-a:1"}, {"url": "http://env-b:2"}]')
    assert [b.url for b in load_settings(config).pool] == ["http://env-a:1", "http://env-b:2"]
    from_flags = load_settings(None, backends=[{"url": "http://flag:3"}])
    assert [(b.name, b.url) for b in from_flags.pool] == [("backend-1", "http://flag:3")]


def test_without_backends_the_upstream_url_is_the_one_backend() -> None:
    s = load_settings(None, upstream_url="http://one:5/", slots=3)
    assert [(b.name, b.url, b.slots) for b in s.pool] == [("backend-1", "http://one:5", 3)]


@pytest.mark.parametrize(
    ("backends", "message"),
    [
        ([{"url": "gpu:1"}], "http://"),
        ([{"url": "http://a:1", "name": "x"}, {"url": "http://b:1", "name": "x"}], "distinct names"),
        ([{"url": "http://a:1", "kind": "tgi"}], "backends.0.kind"),
        ([{"url": "http://a:1", "slots": 0}], "backends.0.slots"),
    ],
)
def test_bad_backends_are_refused_naming_the_setting(backends: list[dict[str, object]], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(None, backends=backends)


def test_serve_takes_repeated_backend_flags() -> None:
    import argparse

    from clairvoyant.proxy.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--backend", "http://a:1", "--backend", "http://b:2"])
    assert args.backends == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize("spell", [str.upper, str.lower], ids=["upper-case", "lower-case"])
def test_precedence_is_defaults_then_file_then_environment_then_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spell: object
) -> None:
    """Each layer overrides the one below it, one setting per layer; the environment in either case."""
    assert callable(spell)
    config = tmp_path / "c.toml"
    config.write_text("slots = 2\nmax_queue = 20\nport = 9020\n")
    monkeypatch.setenv(spell("CLAIRVOYANT_MAX_QUEUE"), "30")
    monkeypatch.setenv(spell("CLAIRVOYANT_PORT"), "9030")
    s = load_settings(config, port=9040)
    assert s.retry_after_s == 1  # default: nobody set it
    assert s.slots == 2  # the file beats the default
    assert s.max_queue == 30  # the environment beats the file
    assert s.port == 9040  # a flag beats the environment


def test_a_lower_case_variable_is_blamed_as_spelled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("clairvoyant_slots", "0")
    with pytest.raises(ConfigError, match=r"invalid setting slots \(clairvoyant_slots\): "):
        load_settings()


def test_a_lower_case_config_variable_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "c.toml"
    config.write_text("max_queue = 5\n")
    monkeypatch.setenv("clairvoyant_config", str(config))
    assert load_settings().max_queue == 5


def test_an_unknown_key_and_a_bad_value_from_the_file_both_stay_clear(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('policy = "lifo"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    assert str(info.value) == (
        f"invalid setting policy (config file {config}, key policy): "
        "Value error, unknown policy 'lifo'; known: fcfs, sjf, boost, hrrn"
    )
    config.write_text("slots = 1\nslotz = 2\n")
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    assert str(info.value) == f"config file {config}: unknown setting 'slotz'; did you mean slots?"


def test_a_retired_key_in_the_file_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = tmp_path / "c.toml"
    config.write_text("park_waiting = true\nslots = 2\n")
    with caplog.at_level("WARNING", logger="clairvoyant.config"):
        assert load_settings(config).slots == 2
    assert any("park_waiting has no effect any more" in r.getMessage() for r in caplog.records)


def test_settings_built_directly_read_no_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "c.toml"
    config.write_text("slots = 3\n")
    monkeypatch.setenv("CLAIRVOYANT_CONFIG", str(config))
    assert Settings().slots == 1  # only load_settings reads the file
    assert load_settings().slots == 3


def test_serve_flags_keep_their_names_and_beat_every_other_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from clairvoyant.proxy.serve import add_arguments

    config = tmp_path / "c.toml"
    config.write_text("slots = 2\nstarvation_timeout_s = 2.0\n")
    monkeypatch.setenv("clairvoyant_starvation_timeout_s", "3")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--config", str(config), "--upstream", "http://u:1", "--slots", "4", "--tau", "5"]
        + ["--learner-state", str(tmp_path / "l.npz"), "--predictor", str(tmp_path / "p.onnx")]
    )
    s = load_settings(args.config, **{name: getattr(args, name) for name in CLI_FLAGS})
    assert (s.upstream_url, s.slots, s.starvation_timeout_s) == ("http://u:1", 4, 5.0)
    assert (s.learner_state_path, s.model_path) == (tmp_path / "l.npz", tmp_path / "p.onnx")
    with pytest.raises(SystemExit):  # a flag's value is checked by its type before the settings
        parser.parse_args(["--slots", "many"])


_ENTRY = '\n[[api_keys]]\nhash = "sha256:{}"\ntenant = "{}"\n'


def test_a_setting_appended_after_a_table_is_refused_naming_the_trap(tmp_path: Path) -> None:
    """`keys add >> clairvoyant.toml`, then `echo 'status_requires_key = true' >> clairvoyant.toml`:
    TOML puts the setting inside the [[api_keys]] table; the message says so and what to do."""
    config = tmp_path / "clairvoyant.toml"
    config.write_text('policy = "sjf"\n' + _ENTRY.format("a" * 64, "team-a") + "status_requires_key = true\n")
    with pytest.raises(ConfigError, match=r"'status_requires_key' is inside a \[\[api_keys\]\] table.*api_keys_file"):
        load_settings(config)
    config.write_text('[[tenants]]\nname = "t"\nslots = 2\n')
    with pytest.raises(ConfigError, match=r"'slots' is inside a \[\[tenants\]\] table"):
        load_settings(config)


def test_the_keys_file_joins_its_keys_and_holds_nothing_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tmp_path / "keys" / "clairvoyant-keys.toml"
    keys.parent.mkdir()
    keys.write_text(_ENTRY.format("b" * 64, "team-b") + _ENTRY.format("c" * 64, "team-c"))
    config = tmp_path / "clairvoyant.toml"
    config.write_text('api_keys_file = "keys/clairvoyant-keys.toml"' + _ENTRY.format("a" * 64, "team-a"))
    monkeypatch.chdir(keys.parent)  # a relative path in the file is from the file's folder, not the working one
    settings = load_settings(config)
    assert [k.tenant for k in settings.api_keys] == ["team-a", "team-b", "team-c"]
    assert settings.api_keys_file == keys
    # a copy of the settings (re-validated) does not take the file's keys twice
    assert Settings.model_validate(settings.model_dump()).api_keys == settings.api_keys
    monkeypatch.setenv("CLAIRVOYANT_API_KEYS_FILE", "clairvoyant-keys.toml")  # elsewhere: from the working folder
    assert [k.tenant for k in load_settings().api_keys] == ["team-b", "team-c"]
    monkeypatch.delenv("CLAIRVOYANT_API_KEYS_FILE")
    keys.write_text(_ENTRY.format("b" * 64, "team-b") + "status_requires_key = true\n")
    with pytest.raises(ConfigError, match=r"api_keys_file .* \[\[api_keys\]\] table 1: status_requires_key: Extra"):
        load_settings(config)
    keys.write_text("status_requires_key = true\n" + _ENTRY.format("b" * 64, "team-b"))
    with pytest.raises(
        ConfigError, match=r"api_keys_file \(config file .*\): .* may hold only \[\[api_keys\]\] tables"
    ):
        load_settings(config)
    keys.unlink()
    with pytest.raises(ConfigError, match=r"api_keys_file .* cannot be read"):
        load_settings(config)


def test_a_starvation_timeout_that_is_not_a_number_is_refused() -> None:
    with pytest.raises(ConfigError, match="starvation_timeout_s"):
        load_settings(starvation_timeout_s=float("nan"))
