"""The one typed, frozen settings object, built once at start.

Lookup order, later wins: defaults → TOML file → environment (``CTXPROXY_<KEY>``) → command-line flags.
Every key is declared here with its parser and a one-line help (datasette's ``SETTINGS``); the commented default
file ``config/default.toml`` and the README's reference are checked against this list by the tests.

Per-model profiles live under ``[models."vendor/model"]``. ``Settings.for_model(slug)`` applies the profile whose
slug is the longest prefix of the model name. A key the operator set explicitly (file, environment or flag) beats
the profile; a key left at its automatic value (``ctx_window = "auto"``, ``context_budget = 0`` …) does not count
as explicit, so ``context_budget = 0`` at the top with a profile that sets ``context_budget = 500000`` gives the
profile's number, as in the seed document.

Nothing reads the environment at import time: ``load_settings`` receives it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctxproxy.config.parsers import (
    Parser,
    Secret,
    parse_bool,
    parse_choice,
    parse_float,
    parse_int,
    parse_optional_secret,
    parse_presets,
    parse_regex,
    parse_store,
    parse_str,
    parse_str_list,
    parse_url,
    parse_window,
)

__all__ = ["SERVER_KEYS", "ModelProfile", "Settings", "SettingsError", "load_settings", "setting_help",
           "unknown_environment"]

ENV_PREFIX = "CTXPROXY_"
DEFAULT_PHRASES = (
    "free up your context",
    "free up context",
    "context window",
    "libera el contexto",
    "ventana de contexto",
)


class SettingsError(Exception):
    """A bad setting: raised at start, never on the request path. The message names key, value and a hint."""


def _opt(default: Any, parse: Parser, help: str, auto: Any = dataclasses.MISSING) -> Any:
    """Declare a setting: its default, its parser, its help line and (optionally) the value that means auto."""
    meta = {"parse": parse, "help": help, "auto": auto}
    if isinstance(default, tuple | list):
        return field(default=tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelProfile:
    """``[models."<slug>"]``: values for models whose name starts with ``slug``."""

    slug: str
    values: Mapping[str, Any]


@dataclass(frozen=True)
class Settings:
    # --- server -----------------------------------------------------------------------------------------------
    upstream: str = _opt("http://127.0.0.1:8080/v1", parse_url, "OpenAI-compatible base URL requests go to")
    host: str = _opt("127.0.0.1", parse_str, "address to bind; anything but loopback requires admin_token")
    port: int = _opt(4141, parse_int(0, 65535), "port to bind (0 = any free port)")
    data_dir: str = _opt("", parse_str, 'journal and overflow directory; "" = $XDG_DATA_HOME/ctxproxy')
    store: str = _opt("", parse_store, 'where the journal lives: "" = SQLite at <data_dir>/journal.db; a '
                      "postgresql://user:password@host:port/database URL = PostgreSQL, which several replicas "
                      "share (needs the postgresql extra)")
    admin_token: Secret | None = _opt(None, parse_optional_secret, "bearer token for /ctx/*, /metrics, healthz "
                                         "details (required off loopback)")
    session_header: str = _opt("X-Session-Id", parse_str, "request header that names the session explicitly")
    incognito: bool = _opt(False, parse_bool, "write nothing to disk for any session (X-Ctx-Incognito: 1 per request)")
    max_body_bytes: int = _opt(64 * 1024 * 1024, parse_int(1024), "largest request body accepted (413 above)")
    max_messages: int = _opt(20_000, parse_int(1), "most messages one chat request may carry (413 above; a long "
                             "agent run sends a few thousand)")
    upstream_connect_timeout: float = _opt(10.0, parse_float(0.1, 3600), "seconds to connect upstream (502 after)")
    upstream_timeout: float = _opt(600.0, parse_float(0.1, 86400), "seconds between upstream bytes (504 after)")
    journal_sync: str = _opt("normal", parse_choice("normal", "full"), "SQLite synchronous: normal survives a "
                             "crash of the proxy, full also a power loss (one fsync per request); on PostgreSQL "
                             "the server's synchronous_commit decides")
    log_level: str = _opt("info", parse_choice("critical", "error", "warning", "info", "debug"), "log level")
    access_log: bool = _opt(False, parse_bool, "uvicorn's per-request log line (the journal records every request)")
    log_format: str = _opt("text", parse_choice("text", "json"), "ctxproxy's own log lines (one per request at "
                           'info, the startup line): "text" sentences, or "json" one object a line with each figure '
                           "as a field")
    # --- clients and exposure (issue #10) ---------------------------------------------------------------------
    metrics_token: Secret | None = _opt(None, parse_optional_secret, "bearer token for /metrics alone (a scraper's); "
                                        "the admin token works there too")
    session_scope: str = _opt("global", parse_choice("global", "credential"), 'who joins a session: "global" = '
                              'anyone naming it; "credential" = only callers with the same Authorization / API key')
    incognito_max_bytes: int = _opt(64 * 1024 * 1024, parse_int(64 * 1024), "memory the incognito journal may "
                                    "hold; above it the oldest incognito sessions are forgotten")
    incognito_max_age: float = _opt(3600.0, parse_float(1.0, 30 * 86400), "seconds an idle incognito session is "
                                    "kept in memory")
    client_header_timeout: float = _opt(30.0, parse_float(0.1, 3600), "seconds a client has to send a request's "
                                        "headers (from connecting or its previous answer); then it is closed")
    client_body_timeout: float = _opt(120.0, parse_float(0.1, 86400), "seconds a client has to send a request's "
                                      "whole body (408 after)")
    max_connections: int = _opt(512, parse_int(1), "open client connections; one more is answered 503 and closed")
    # --- budget and tokens (DESIGN.md §3) ---------------------------------------------------------------------
    ctx_window: int = _opt(0, parse_window, 'the model\'s physical window; "auto" asks upstream, else 131072',
                           auto=0)
    context_budget: int = _opt(0, parse_int(0), "0 = auto: 100k when window ≤ 300k, else 200k", auto=0)
    context_reserve: int = _opt(8192, parse_int(0), "room kept for the next answer")
    context_target: int = _opt(0, parse_int(0), "0 = auto: 70% of budget; elision stops here", auto=0)
    keep_results: int = _opt(5, parse_int(0), "newest tool results auto-elision never touches")
    spill_chars: int = _opt(0, parse_int(0), "0 = auto (~a tenth of the budget in chars): bigger results spill",
                            auto=0)
    fold_history: bool = _opt(True, parse_bool, "fold oldest whole turns as a last resort (false = clear error)")
    # --- context tools (DESIGN.md §5) -------------------------------------------------------------------------
    tools_enabled: bool = _opt(True, parse_bool, "offer and execute the context tools")
    offer_pct: float = _opt(0.45, parse_float(0.0, 1.0), "usage (share of the budget) from which tools are offered")
    offer_round: int = _opt(12, parse_int(0), "mid-turn round from which tools are offered; 0 = usage only")
    offer_phrases: tuple[str, ...] = _opt(DEFAULT_PHRASES, parse_str_list, "phrases of the person that offer them")
    max_pins: int = _opt(20, parse_int(0), "model pins per session")
    soft_ceiling_pct: float = _opt(0.85, parse_float(0.0, 1.0),
                                   "usage (share of the budget) at which a one-line reminder is added")
    keep_tool_rounds: int = _opt(3, parse_int(0), "text-protocol route: newest rounds auto-elision never touches")
    max_context_rounds: int = _opt(4, parse_int(1, 32), "internal re-asks per client request")
    paste_chars: int = _opt(20000, parse_int(0), "a pasted attachment above this goes to overflow")
    approval_pattern: str = _opt(r"approval[_ ]id[=: ]+\S+", parse_regex, "what marks a pending approval")
    native_tools: bool = _opt(True, parse_bool, "upstream handles function calling (else fenced note only)")
    responses_upstream: str = _opt("translated", parse_choice("translated", "native"), "how /v1/responses reaches "
                                   'the upstream: "translated" to its chat completions, "native" to its own '
                                   "/v1/responses (an OpenAI Responses endpoint)")
    null_content: str = _opt("keep", parse_choice("keep", "empty"), 'assistant "content": null upstream; '
                             '"empty" sends "" (llama-cpp-python answers null with a 500)')
    route: str = _opt("auto", parse_choice("auto", "native", "fenced"), "tool-call protocol of the agent")
    anthropic_upstream: str = _opt("translated", parse_choice("translated", "native"), "how /v1/messages reaches "
                                   'the upstream: "translated" to its chat completions, "native" to its own '
                                   "/v1/messages (api.anthropic.com, llama.cpp, vLLM)")
    fenced_presets: tuple[tuple[str, str], ...] = _opt((), parse_presets, "your own text-protocol formats: "
                                                       "[{name, pattern with (?P<body>…)}], tried first")
    mirror_dir: str = _opt("", parse_str, 'where LIVE_CONTEXT.json is written, in a folder per '
                           'session: <mirror_dir>/<session>; "" = <data_dir>/mirror')
    overflow_dir: str = _opt("", parse_str, "also write every cut body here as <id>.out, named in its stub, for an "
                             'agent without read_overflow (e.g. its workspace); "" = off; never in incognito')
    # --- not settable by key: built by load_settings ------------------------------------------------------------
    profiles: tuple[ModelProfile, ...] = field(default=(), metadata={"internal": True})
    explicit: frozenset[str] = field(default=frozenset(), metadata={"internal": True})

    def for_model(self, model: str | None) -> Settings:
        """These settings with the longest-prefix profile of ``model`` applied under the explicit keys."""
        if not model or not self.profiles:
            return self
        matches = [p for p in self.profiles if model.startswith(p.slug)]
        if not matches:
            return self
        best = max(matches, key=lambda p: len(p.slug))
        values = {k: v for k, v in best.values.items() if k not in self.explicit}
        return dataclasses.replace(self, **values) if values else self

    @property
    def data_path(self) -> Path:
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        return Path(home) / "ctxproxy"

    @property
    def journal_location(self) -> Path | str:
        """The journal's file (SQLite) or ``postgresql://`` URL (``store``)."""
        return self.store or self.data_path / "journal.db"

    @property
    def is_loopback(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1") or self.host.startswith("127.")


SETTABLE = {f.name: f for f in dataclasses.fields(Settings) if not f.metadata.get("internal")}
SERVER_KEYS = frozenset({
    "upstream", "host", "port", "data_dir", "store", "admin_token", "session_header", "incognito", "max_body_bytes",
    "upstream_connect_timeout", "upstream_timeout", "journal_sync", "log_level", "access_log",
    "log_format", "metrics_token", "session_scope", "incognito_max_bytes", "incognito_max_age", "client_header_timeout",
    "client_body_timeout", "max_connections",
    "max_messages",
})
"""Keys that describe the process, not a model: a ``[models.*]`` profile may not set them."""


def setting_help(name: str) -> str:
    return str(SETTABLE[name].metadata["help"])


def _parse(key: str, value: Any, where: str) -> Any:
    if key not in SETTABLE:
        import difflib  # only for a key that names no setting: not loaded by every start (issue #13)

        close = difflib.get_close_matches(key, SETTABLE, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "see config/default.toml for every key"
        raise SettingsError(f"Unknown setting {key!r} in {where}. Hint: {hint}")
    try:
        return SETTABLE[key].metadata["parse"](value)
    except ValueError as exc:
        shown = "**********" if SETTABLE[key].metadata["parse"] in (parse_optional_secret, parse_store) else repr(value)
        raise SettingsError(f"Setting {key!r} = {shown} (from {where}) is not valid. Hint: {exc}") from None


def _is_explicit(key: str, value: Any) -> bool:
    auto = SETTABLE[key].metadata["auto"]
    return auto is dataclasses.MISSING or value != auto


def _read_toml(path: Path) -> dict[str, Any]:
    import tomllib  # only when a config file is given: not loaded by every start (issue #13)

    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise SettingsError(f"Config file {str(path)!r} does not exist. "
                            "Hint: check --config / CTXPROXY_CONFIG") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"Config file {str(path)!r} is not valid TOML: {exc}") from None


def _parse_profiles(raw: Any, where: str) -> tuple[ModelProfile, ...]:
    if not isinstance(raw, dict):
        raise SettingsError(f'[models] in {where} must be tables such as [models."vendor/model"]')
    profiles = []
    for slug, table in raw.items():
        if not isinstance(table, dict):
            raise SettingsError(f'[models.{slug!r}] in {where} must be a table of settings')
        for key in table:
            if key in SERVER_KEYS:
                raise SettingsError(f"Setting {key!r} in [models.{slug!r}] ({where}) is not per model. "
                                    "Hint: set it at the top level")
        values = {k: _parse(k, v, f'[models."{slug}"] in {where}') for k, v in table.items()}
        profiles.append(ModelProfile(slug, values))
    return tuple(profiles)


NOT_SETTINGS = frozenset({"CONFIG", "TRAJECTORIES", "TEST_CACHE"})
"""``CTXPROXY_*`` variables that are not settings: the file to read, and the test suite's corpus and cache."""


def unknown_environment(env: Mapping[str, str]) -> list[str]:
    """A warning for each ``CTXPROXY_*`` variable that names no setting, with the closest key (a typo in the
    environment was silently ignored, where the same typo in the TOML file is an error). A warning, not an error:
    other tools may share the prefix."""
    out = []
    for key in sorted(env):
        name = key.removeprefix(ENV_PREFIX)
        if not key.startswith(ENV_PREFIX) or name in NOT_SETTINGS or name.lower() in SETTABLE:
            continue
        import difflib

        close = difflib.get_close_matches(name.lower(), SETTABLE, n=1)
        hint = f"did you mean {ENV_PREFIX}{close[0].upper()}?" if close else "see config/default.toml for every key"
        out.append(f"environment variable {key} is not a setting and is ignored. Hint: {hint}")
    return out


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out = {}
    for name in SETTABLE:
        key = ENV_PREFIX + name.upper()
        if key in env and (env[key] != "" or name in ("admin_token", "metrics_token")):
            out[name] = _parse(name, env[key], f"environment variable {key}")
    return out


def load_settings(
    config_file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Settings:
    """Defaults → TOML → environment → flags. ``config_file`` falls back to ``CTXPROXY_CONFIG``."""
    env = {} if env is None else env
    values: dict[str, Any] = {}
    explicit: set[str] = set()
    profiles: tuple[ModelProfile, ...] = ()
    path = config_file or env.get(ENV_PREFIX + "CONFIG")
    if path:
        where = str(path)
        raw = _read_toml(Path(path))
        profiles = _parse_profiles(raw.pop("models", {}), where)
        values.update({k: _parse(k, v, where) for k, v in raw.items()})
    values.update(_from_env(env))
    values.update({k: _parse(k, v, f"flag --{k.replace('_', '-')}") for k, v in (flags or {}).items()
                   if v is not None})
    explicit = {k for k, v in values.items() if _is_explicit(k, v)}
    settings = Settings(**values, profiles=profiles, explicit=frozenset(explicit))
    _check_consistency(settings)
    return settings


def _check_consistency(s: Settings) -> None:
    if not s.is_loopback and s.admin_token is None:
        raise SettingsError(
            f"Refusing to bind {s.host!r} without an admin token: /ctx/* would be open to the network. "
            "Hint: set CTXPROXY_ADMIN_TOKEN, or bind 127.0.0.1")
    if s.context_budget and s.context_target and s.context_target > s.context_budget:
        raise SettingsError(f"Setting 'context_target' = {s.context_target} is above context_budget = "
                            f"{s.context_budget}. Hint: the target is where elision stops, below the budget")
