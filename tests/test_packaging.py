"""The container files, checked as far as a machine without a Docker engine allows.

``docker-compose config`` (Debian's docker-compose, installed by scripts/test-deps) parses and validates the
compose file without an engine. The image's entry point must be the same ``ctxproxy serve`` the tests start.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from config import load_settings

ROOT = Path(__file__).resolve().parent.parent


def compose_config(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CTXPROXY_")}
    return subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config"], cwd=ROOT,
                          env=clean | env, capture_output=True, text=True, timeout=60)


def test_the_compose_file_is_valid_and_wires_the_proxy_to_llama_cpp() -> None:
    result = compose_config(CTXPROXY_ADMIN_TOKEN="t", MODEL_FILE="smol.gguf")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "CTXPROXY_UPSTREAM: http://llama:8080/v1" in text
    assert "/models/smol.gguf" in text
    assert "- ctxproxy-data:/data:rw" in text and "ctxproxy-data: {}" in text  # data on a named volume
    assert "- 127.0.0.1:4141:4141/tcp" in text  # published on loopback only


def test_the_compose_file_demands_an_admin_token() -> None:
    result = compose_config()
    assert result.returncode != 0 and "CTXPROXY_ADMIN_TOKEN" in result.stderr


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_the_image_runs_the_same_ctxproxy_serve_as_the_tests() -> None:
    entry = re.search(r"^ENTRYPOINT (.+)$", dockerfile(), flags=re.M)
    assert entry is not None and json.loads(entry.group(1)) == ["ctxproxy", "serve"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["ctxproxy"] == "proxy.cli:main"


def test_the_image_copies_every_package_and_sets_valid_settings() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    for package in packages:
        assert re.search(rf"^COPY {package} \./{package}$", dockerfile(), flags=re.M), package
    env = dict(re.findall(r"(CTXPROXY_\w+)=(\S+)", dockerfile()))
    assert set(env) == {"CTXPROXY_DATA_DIR", "CTXPROXY_HOST", "CTXPROXY_PORT"}
    settings = load_settings(env=env | {"CTXPROXY_ADMIN_TOKEN": "t"})
    assert settings.host == "0.0.0.0" and settings.port == 4141
    with pytest.raises(Exception, match="ADMIN_TOKEN"):
        load_settings(env=env)
