"""Regenerates the settings reference from ``config.settings``: ``config/default.toml`` and the README's table.

    .venv/bin/python scripts/config_docs.py           # rewrite both
    .venv/bin/python scripts/config_docs.py --check   # exit 1 if either is stale (the tests run this)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ctxproxy.config.settings import SETTABLE, Settings  # noqa: E402

SECTIONS = {"upstream": "Server", "metrics_token": "Clients and exposure",
            "ctx_window": "Budget and tokens (DESIGN.md §3)", "tools_enabled": "Context tools (DESIGN.md §5)"}
TABLE_HEAD = "| key | default | environment | meaning |\n|---|---|---|---|\n"
TABLE_END = "\n\nServer keys"


def toml_value(name: str, value: Any) -> str:
    if name == "ctx_window":
        return '"auto"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple):
        return json.dumps(list(value), ensure_ascii=False)
    if value is None:
        return '""'
    return f"'{value}'" if "\\" in value else json.dumps(value, ensure_ascii=False)


def default_toml() -> str:
    defaults = Settings()
    out = ["# ctxproxy settings: every key, commented out, at its default. `##` lines say what a key means.",
           "# Lookup order, later wins: defaults -> this file (--config / CTXPROXY_CONFIG) -> CTXPROXY_<KEY> -> flags."]
    for name, field in SETTABLE.items():
        if name in SECTIONS:
            out += ["", f"# --- {SECTIONS[name]} " + "-" * (100 - len(SECTIONS[name])), ""]
        out += [f"## {field.metadata['help']}", f"# {name} = {toml_value(name, getattr(defaults, name))}"]
    out += ["", "# --- Per-model profiles " + "-" * 80, "",
            "# The longest matching slug prefix wins; a key set explicitly above beats the profile, a key left at its",
            '# automatic value (ctx_window = "auto", context_budget = 0, ...) does not.',
            '# [models."vendor/model"]', "# context_budget = 500000", "# context_target = 350000", ""]
    return "\n".join(out)


def readme_table() -> str:
    defaults = Settings()
    rows = []
    for name, field in SETTABLE.items():
        value = getattr(defaults, name)
        shown = "the 5 phrases of DESIGN.md §5" if name == "offer_phrases" else (
            "unset" if value is None else toml_value(name, value))
        meaning = str(field.metadata["help"]).replace("|", "\\|")
        rows.append(f"| `{name}` | `{shown}` | `CTXPROXY_{name.upper()}` | {meaning} |")
    return TABLE_HEAD + "\n".join(rows)


def with_table(readme: str) -> str:
    start, end = readme.index(TABLE_HEAD), readme.index(TABLE_END)
    return readme[:start] + readme_table() + readme[end:]


def main(argv: list[str]) -> int:
    targets = {ROOT / "config" / "default.toml": default_toml(),
               ROOT / "README.md": with_table((ROOT / "README.md").read_text())}
    stale = [path for path, text in targets.items() if path.read_text() != text]
    if "--check" in argv:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run scripts/config_docs.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(targets[path])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
