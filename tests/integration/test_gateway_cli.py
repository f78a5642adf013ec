"""``prefixroute serve`` and ``doctor`` as a user runs them: bad input is one clear line and
exit code 2, never a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from prefixroute.edges.gateway.config import hash_api_key
from prefixroute.edges.listen import free_port

SECRET_ENV = {"PR_CLI_SECRET": "c" * 64}


def cli(*args, stdin=None, env=None):
    return subprocess.run([sys.executable, "-m", "prefixroute", *args], capture_output=True,
                          text=True, timeout=60, input=stdin, env={**os.environ, **(env or {})})


def config_file(tmp_path, extra=""):
    path = tmp_path / "gateway.yaml"
    path.write_text(f"""\
server_secret: {{env: PR_CLI_SECRET}}
backends:
  - url: http://127.0.0.1:9
    models: [tiny]
tenants:
  - name: a
    api_key_sha256: {hash_api_key("k")}
{extra}""")
    return path


def test_check_prints_the_validated_config(tmp_path):
    result = cli("serve", "--config", str(config_file(tmp_path)), "--check", env=SECRET_ENV)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["backends"][0]["url"] == "http://127.0.0.1:9"
    assert summary["tenants"] == [{"name": "a", "trust_group": "a", "admin": False, "keys": 1}]


def test_bad_config_is_exit_2_naming_file_line_and_field(tmp_path):
    path = config_file(tmp_path, "retries: -1\n")
    result = cli("serve", "--config", str(path), env=SECRET_ENV)
    assert result.returncode == 2
    assert f"{path}:8: must be at least 0" in result.stderr and "'retries'" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_secret_is_exit_2(tmp_path):
    result = cli("serve", "--config", str(config_file(tmp_path)), "--check")
    assert result.returncode == 2 and "PR_CLI_SECRET is not set" in result.stderr


def test_port_in_use_is_exit_2(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli("serve", "--config", str(config_file(tmp_path)), "--port", str(port),
                     env=SECRET_ENV)
    assert result.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in result.stderr


def test_hash_key_prints_the_digest_to_store():
    result = cli("serve", "--hash-key", stdin="sk-acme-example-key\n")
    assert result.stdout.strip() == hash_api_key("sk-acme-example-key")


def test_doctor_on_an_unreachable_backend_is_exit_2():
    port = free_port()  # nothing listens there
    result = cli("doctor", "--backend", f"http://127.0.0.1:{port}")
    assert result.returncode == 2 and "cannot reach the backend" in result.stderr
    assert "Traceback" not in result.stderr


def test_doctor_on_an_unreachable_gateway_is_exit_2():
    port = free_port()  # nothing listens there
    result = cli("doctor", "--gateway", f"http://127.0.0.1:{port}")
    assert result.returncode == 2 and "cannot read the gateway's metrics" in result.stderr
    assert "Traceback" not in result.stderr
