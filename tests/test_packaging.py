"""The container files, checked as far as a machine without a Docker engine allows.

``docker-compose config`` (Debian's docker-compose, installed by scripts/test-deps) parses and validates the
compose file without an engine. The image's entry point must be the same ``ctxproxy serve`` the tests start.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from ctxproxy.config import load_settings
from ctxproxy.proxy.edge.app import create_app
from tests.fakes import serve_in_thread

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
    assert project["project"]["scripts"]["ctxproxy"] == "ctxproxy.proxy.commands.cli:main"


def test_the_image_copies_every_package_and_sets_valid_settings() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    for package in packages:
        assert re.search(rf"^COPY {package} \./{package}$", dockerfile(), flags=re.M), package
    code = "\n".join(line for line in dockerfile().splitlines() if not line.lstrip().startswith("#"))
    env = dict(re.findall(r"(CTXPROXY_\w+)=(\S+)", code))  # a comment's example is not a setting
    assert set(env) == {"CTXPROXY_DATA_DIR", "CTXPROXY_HOST", "CTXPROXY_PORT"}
    settings = load_settings(env=env | {"CTXPROXY_ADMIN_TOKEN": "t"})
    assert settings.host == "0.0.0.0" and settings.port == 4141
    with pytest.raises(Exception, match="ADMIN_TOKEN"):
        load_settings(env=env)


def compose(**env: str) -> dict[str, Any]:
    result = compose_config(CTXPROXY_ADMIN_TOKEN="t", **env)
    assert result.returncode == 0, result.stderr
    loaded: dict[str, Any] = yaml.safe_load(result.stdout)
    return loaded


def test_the_proxy_waits_for_a_healthy_model_server_whose_window_it_is_given() -> None:
    services = compose(CTX_WINDOW="8192")["services"]
    llama, proxy = services["llama"], services["ctxproxy"]
    assert llama["healthcheck"]["test"][-1] == "http://127.0.0.1:8080/health"
    assert proxy["depends_on"] == {"llama": {"condition": "service_healthy"}}
    command = llama["command"]
    assert command[command.index("-c") + 1] == "8192" and proxy["environment"]["CTXPROXY_CTX_WINDOW"] == "8192"


def test_a_vllm_profile_runs_its_own_proxy_beside_the_llama_cpp_one() -> None:
    services = compose(CTX_WINDOW="16384")["services"]
    vllm, proxy = services["vllm"], services["ctxproxy-vllm"]
    assert vllm["profiles"] == ["vllm"] == proxy["profiles"] and "healthcheck" in vllm
    assert vllm["command"][vllm["command"].index("--max-model-len") + 1] == "16384"
    assert proxy["environment"]["CTXPROXY_UPSTREAM"] == "http://vllm:8000/v1"
    assert proxy["environment"]["CTXPROXY_CTX_WINDOW"] == "16384"
    assert proxy["depends_on"] == {"vllm": {"condition": "service_healthy"}}
    assert proxy["ports"] != services["ctxproxy"]["ports"] and proxy["volumes"] != services["ctxproxy"]["volumes"]


def test_images_are_pinned_and_the_obsolete_version_key_is_gone() -> None:
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert "version" not in raw
    images = [s["image"] for s in raw["services"].values() if "image" in s and "build" not in s]  # built: our tag
    images.append(re.search(r"^FROM (\S+)", dockerfile(), flags=re.M).group(1))  # type: ignore[union-attr]
    for image in images:
        tag = image.rpartition(":")[2]
        assert any(c.isdigit() for c in tag) and tag not in ("latest", "server"), image


def test_the_image_health_check_asks_the_proxy_healthz(tmp_path: Path) -> None:
    check = re.search(r"^HEALTHCHECK [^\n]*\\\n\s*CMD (\[.+\])$", dockerfile(), flags=re.M)
    assert check is not None
    command = json.loads(check.group(1))
    assert command[0] == "python"
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1"})
    with serve_in_thread(create_app(settings)) as url:
        port = url.rpartition(":")[2]
        up = subprocess.run([sys.executable, *command[1:]], env={"CTXPROXY_PORT": port}, timeout=30)
    down = subprocess.run([sys.executable, *command[1:]], env={"CTXPROXY_PORT": port}, capture_output=True,
                          timeout=30)
    assert up.returncode == 0 and down.returncode != 0


def test_the_wheel_installs_one_top_level_name_with_the_three_folders_inside(tmp_path: Path) -> None:
    """``proxy``, ``store`` and ``config`` would collide with any package of that name in the user's environment:
    the wheel holds them under ``ctxproxy`` only, as real folders (the checkout's links are followed)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("ctxproxy-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"ctxproxy"}
    for module in ("ctxproxy/proxy/engine/turn.py", "ctxproxy/proxy/core/project.py", "ctxproxy/store/journal.py",
                   "ctxproxy/config/default.toml", "ctxproxy/proxy/py.typed",
                   "ctxproxy/proxy/edge/ui/app.js"):
        assert module in names, module


NGINX_CONF = ROOT / "deploy" / "nginx.conf"


def nginx_directives(text: str) -> list[list[str]]:
    """Each directive of an nginx config as its words, comments dropped (enough for the checks below)."""
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    return [part.split() for part in re.split(r"[;{}]", code) if part.strip()]


def test_the_scale_profile_puts_two_replicas_on_postgres_behind_a_balancer() -> None:
    services = compose(POSTGRES_PASSWORD="pw")["services"]
    scale = {name for name, s in services.items() if "scale" in s.get("profiles", [])}
    assert scale == {"postgres", "ctxproxy-a", "ctxproxy-b", "lb"}
    postgres = services["postgres"]
    assert postgres["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    assert any(v.endswith(":/var/lib/postgresql/data:rw") for v in postgres["volumes"])
    store = "postgresql://ctxproxy:pw@postgres:5432/ctxproxy"
    for name in ("ctxproxy-a", "ctxproxy-b"):
        replica = services[name]
        assert replica["environment"]["CTXPROXY_STORE"] == store, name
        assert replica["environment"]["CTXPROXY_UPSTREAM"] == "http://llama:8080/v1"  # the existing model server
        assert replica["depends_on"] == {"postgres": {"condition": "service_healthy"},
                                         "llama": {"condition": "service_healthy"}}
        assert "/healthz" in replica["healthcheck"]["test"][-1] and "ports" not in replica  # only the lb is published
    assert services["ctxproxy-a"]["image"] == services["ctxproxy-b"]["image"]
    assert "'.[postgresql]'" in dockerfile()  # the image can open a postgresql:// store
    volumes = [set(services[name]["volumes"]) for name in ("ctxproxy-a", "ctxproxy-b")]
    assert "ctxproxy-mirror:/mirror:rw" in volumes[0] & volumes[1]  # one mirror folder, the data dirs apart
    assert len(volumes[0] - volumes[1]) == 1
    assert services["ctxproxy-a"]["environment"]["CTXPROXY_MIRROR_DIR"] == "/mirror"
    lb = services["lb"]
    assert lb["depends_on"] == {"ctxproxy-a": {"condition": "service_healthy"},
                                "ctxproxy-b": {"condition": "service_healthy"}}
    assert lb["ports"] == services["ctxproxy"]["ports"]  # agents keep their address: 127.0.0.1:4141
    assert "/lb-healthz" in lb["healthcheck"]["test"][-1]
    assert any(v.startswith(f"{NGINX_CONF}:/etc/nginx/nginx.conf") for v in lb["volumes"])


def test_the_balancer_round_robins_without_affinity_and_streams_unbuffered() -> None:
    directives = nginx_directives(NGINX_CONF.read_text())
    names = [d[0] for d in directives]
    servers = [d[1] for d in directives if d[0] == "server" and len(d) > 1]
    assert servers == ["ctxproxy-a:4141", "ctxproxy-b:4141"]
    assert not {"ip_hash", "hash", "sticky", "least_conn", "random"} & set(names)  # plain round-robin
    assert ["proxy_buffering", "off"] in directives and ["proxy_request_buffering", "off"] in directives
    assert ["listen", "4141"] in directives and ["location", "=", "/lb-healthz"] in directives
    for timeout in ("proxy_read_timeout", "proxy_send_timeout"):
        (value,) = [d[1] for d in directives if d[0] == timeout]
        assert int(value.rstrip("s")) >= 600, timeout  # a model may think for minutes before its first token
    (retry,) = [d[1:] for d in directives if d[0] == "proxy_next_upstream"]
    assert "non_idempotent" not in retry  # a POST a replica received is never sent again
