"""Settings: one typed object, built defaults → TOML → env → flags, with per-model profiles, failing at start."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ctxproxy.config import Settings, SettingsError, load_settings
from ctxproxy.config.settings import SETTABLE

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ctxproxy.toml"
    path.write_text(text)
    return path


def test_defaults_match_the_design() -> None:
    s = load_settings(env={})
    assert s.upstream == "http://127.0.0.1:8080/v1"
    assert (s.host, s.port) == ("127.0.0.1", 4141)
    assert (s.ctx_window, s.context_budget, s.context_reserve, s.context_target) == (0, 0, 8192, 0)
    assert (s.keep_results, s.spill_chars, s.max_pins, s.max_context_rounds) == (5, 0, 20, 4)
    assert (s.offer_pct, s.offer_round, s.soft_ceiling_pct, s.paste_chars) == (0.45, 12, 0.85, 20000)
    assert s.tools_enabled and s.fold_history and s.admin_token is None


def test_later_sources_win_file_then_env_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, 'port = 5000\nupstream = "http://10.0.0.1:8000/v1"\nkeep_results = 7\n')
    env = {"CTXPROXY_PORT": "6000", "CTXPROXY_KEEP_RESULTS": "9"}
    s = load_settings(path, env, {"port": 7000, "host": None})
    assert s.port == 7000  # flag beats env beats file
    assert s.keep_results == 9  # env beats file
    assert s.upstream == "http://10.0.0.1:8000/v1"  # file beats default
    assert s.host == "127.0.0.1"  # a flag left unset changes nothing


def test_config_path_comes_from_the_environment_too(tmp_path: Path) -> None:
    path = write(tmp_path, "ctx_window = 32768\n")
    assert load_settings(env={"CTXPROXY_CONFIG": str(path)}).ctx_window == 32768


def test_every_setting_can_be_set_from_the_environment() -> None:
    s = load_settings(env={"CTXPROXY_CTX_WINDOW": "auto", "CTXPROXY_OFFER_PCT": "0.5",
                           "CTXPROXY_TOOLS_ENABLED": "off", "CTXPROXY_OFFER_PHRASES": '["a, b", "c"]',
                           "CTXPROXY_ADMIN_TOKEN": "t0ken", "CTXPROXY_APPROVAL_PATTERN": "ok[0-9]+"})
    assert s.ctx_window == 0 and s.offer_pct == 0.5 and not s.tools_enabled
    assert s.offer_phrases == ("a, b", "c")
    assert str(s.admin_token) == "t0ken" and "t0ken" not in repr(s)


@pytest.mark.parametrize(
    ("key", "value", "hint"),
    [
        ("ctx_window", "big", '"auto" or a number'),
        ("port", "70000", "between 0 and 65535"),
        ("offer_pct", "1.5", "between 0.0 and 1.0"),
        ("tools_enabled", "maybe", "true or false"),
        ("upstream", "localhost:8080", "http(s) URL"),
        ("approval_pattern", "(unclosed", "regular expression"),
        ("journal_sync", "sometimes", "normal, full"),
        ("keep_results", "-1", "at least 0"),
    ],
)
def test_a_bad_value_fails_at_start_naming_key_value_and_hint(key: str, value: str, hint: str) -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(env={f"CTXPROXY_{key.upper()}": value})
    message = str(err.value)
    assert repr(key) in message and repr(value) in message and hint in message
    assert f"CTXPROXY_{key.upper()}" in message


def test_an_unknown_key_in_the_file_suggests_the_closest(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="did you mean 'keep_results'"):
        load_settings(write(tmp_path, "keep_result = 3\n"), {})


def test_a_wrong_type_in_the_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="'max_pins' = 'many'"):
        load_settings(write(tmp_path, 'max_pins = "many"\n'), {})


def test_invalid_toml_and_missing_files_are_reported(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings(write(tmp_path, "port = \n"), {})
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(tmp_path / "nope.toml", {})


def test_binding_beyond_loopback_requires_an_admin_token() -> None:
    with pytest.raises(SettingsError, match="CTXPROXY_ADMIN_TOKEN"):
        load_settings(env={"CTXPROXY_HOST": "0.0.0.0"})
    assert load_settings(env={"CTXPROXY_HOST": "0.0.0.0", "CTXPROXY_ADMIN_TOKEN": "x"}).host == "0.0.0.0"


def test_the_admin_token_value_never_appears_in_an_error() -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(env={"CTXPROXY_ADMIN_TOKEN": "secret-value", "CTXPROXY_PORT": "x"})
    assert "secret-value" not in str(err.value)


@pytest.mark.parametrize("key", ["admin_token", "metrics_token"])
def test_a_token_of_only_whitespace_is_refused_naming_the_key(tmp_path: Path, key: str) -> None:
    with pytest.raises(SettingsError, match=f"'{key}'.*only whitespace"):
        load_settings(env={f"CTXPROXY_{key.upper()}": "   "})
    with pytest.raises(SettingsError, match=f"'{key}'.*only whitespace"):
        load_settings(write(tmp_path, f'{key} = "\\t "\n'), {})
    with pytest.raises(SettingsError, match="CTXPROXY_ADMIN_TOKEN"):  # off loopback it counts as no token at all
        load_settings(env={"CTXPROXY_HOST": "0.0.0.0", "CTXPROXY_ADMIN_TOKEN": ""})


def test_target_above_budget_is_refused() -> None:
    with pytest.raises(SettingsError, match="context_target"):
        load_settings(env={"CTXPROXY_CONTEXT_BUDGET": "1000", "CTXPROXY_CONTEXT_TARGET": "2000"})


PROFILES = """
context_budget = 0
keep_results = 4
[models."qwen"]
context_budget = 50000
keep_results = 8
[models."qwen/qwen3-coder"]
context_budget = 500000
context_target = 350000
"""


def test_the_longest_matching_profile_wins(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, PROFILES), {})
    coder = s.for_model("qwen/qwen3-coder-30b")
    assert (coder.context_budget, coder.context_target) == (500000, 350000)
    assert s.for_model("qwen/qwen2.5").context_budget == 50000
    assert s.for_model("llama-3").context_budget == 0
    assert s.for_model(None) is s


def test_an_explicit_key_beats_the_profile_but_an_auto_value_does_not(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, PROFILES), {"CTXPROXY_CONTEXT_TARGET": "1000"})
    qwen = s.for_model("qwen/qwen2.5")
    assert qwen.keep_results == 4  # set explicitly at the top: beats the profile's 8
    assert qwen.context_budget == 50000  # 0 at the top means auto: the profile fills it
    assert s.for_model("qwen/qwen3-coder").context_target == 1000  # explicit from the environment


def test_a_profile_may_not_set_server_keys_or_bad_values(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="not per model"):
        load_settings(write(tmp_path, '[models."m"]\nport = 1\n'), {})
    with pytest.raises(SettingsError, match=r'models\."m"'):
        load_settings(write(tmp_path, '[models."m"]\nkeep_results = "x"\n'), {})


def test_settings_are_frozen() -> None:
    s = load_settings(env={})
    with pytest.raises(AttributeError):
        s.port = 1  # type: ignore[misc]


def test_the_default_file_lists_every_key_at_its_default() -> None:
    text = (ROOT / "config" / "default.toml").read_text().split("# --- Per-model profiles")[0]
    pairs = dict(re.findall(r"^# (\w+) = (.*)$", text, flags=re.M))
    assert set(pairs) == set(SETTABLE)
    uncommented = load_settings(env={}, flags=tomllib.loads("\n".join(f"{k} = {v}" for k, v in pairs.items())))
    assert all(getattr(uncommented, key) == getattr(Settings(), key) for key in SETTABLE)


def test_the_readme_documents_every_key() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [key for key in SETTABLE if f"| `{key}` |" not in readme]
    assert not missing, f"README lacks: {missing}"


def test_the_generated_reference_is_current() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "config_docs.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
