"""Connecting: passwords, ACL users and TLS against real servers; every mistake is one line that names the URL
without its secret, in seconds; a Redis that is not there is one line and a non-zero exit, no traceback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollstream.shared.config import RedisConfig
from rollstream.shared.embedded import EmbeddedRedis, free_port
from rollstream.shared.redis_io import RedisUnavailable, connect
from tests.faults.conftest import CONFIG, REPO

SECRET = "s3cret-pw"


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path / "pw", extra_args=("--requirepass", SECRET)) as server:
        yield server


def _cli(url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"ROLLSTREAM_REDIS_URL": url, "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "rollstream", *args], env=env, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)


def _one_clear_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    [line] = [s for s in proc.stderr.splitlines() if s.startswith("rollstream: error:")]
    assert SECRET not in proc.stderr + proc.stdout
    return line


def test_a_missing_or_wrong_password_is_one_line_without_the_secret(password_redis: EmbeddedRedis) -> None:
    port = password_redis.port
    with pytest.raises(RedisUnavailable, match="requires a password and the URL gives none"):
        connect(f"redis://127.0.0.1:{port}/0", RedisConfig())
    with pytest.raises(RedisUnavailable, match=r"redis://:\*\*\*@127.0.0.1.*refused the credentials") as info:
        connect(f"redis://:wrong-{SECRET}@127.0.0.1:{port}/0", RedisConfig())
    assert SECRET not in str(info.value)
    assert connect(f"redis://:{SECRET}@127.0.0.1:{port}/0", RedisConfig()).ping()


def test_the_trainer_with_a_wrong_password_exits_with_one_line(password_redis: EmbeddedRedis, tmp_path) -> None:
    proc = _cli(f"redis://:x{SECRET}@127.0.0.1:{password_redis.port}/0", tmp_path, "trainer", str(CONFIG),
                f"output_dir={tmp_path}", "wandb_mode=disabled")
    assert "refused the credentials" in _one_clear_line(proc)


def test_an_acl_user_without_dangerous_commands_connects(password_redis: EmbeddedRedis) -> None:
    admin = connect(f"redis://:{SECRET}@127.0.0.1:{password_redis.port}/0", RedisConfig())
    admin.acl_setuser("trainer", enabled=True, passwords=[f"+{SECRET}"], keys=["rollstream:*"],
                      commands=["+@all", "-@dangerous"])
    client = connect(f"redis://trainer:{SECRET}@127.0.0.1:{password_redis.port}/0", RedisConfig())
    assert client.set("rollstream:x:version", 1)


def test_a_redis_that_is_not_there_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    for command in (["trainer", str(CONFIG)], ["producer", str(CONFIG), "--worker-rank", "0"]):
        proc = _cli(f"redis://127.0.0.1:{free_port()}/0", tmp_path, *command, f"output_dir={tmp_path}",
                    "wandb_mode=disabled")
        assert "cannot reach Redis" in _one_clear_line(proc)


# ---- TLS ----

@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and a server certificate for 127.0.0.1, made with openssl."""
    d = tmp_path_factory.mktemp("tls")
    run = [lambda *a: subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True)][0]
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=rollstream-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "ext")
    return d


@pytest.fixture
def tls_redis(tmp_path: Path, certificates: Path) -> Iterator[tuple[EmbeddedRedis, int]]:
    tls_port = free_port()
    args = ("--tls-port", str(tls_port), "--tls-cert-file", str(certificates / "server.crt"),
            "--tls-key-file", str(certificates / "server.key"), "--tls-ca-cert-file", str(certificates / "ca.crt"),
            "--tls-auth-clients", "no")
    with EmbeddedRedis(tmp_path / "tls", extra_args=args) as server:  # plain port too, for the mismatch case
        yield server, tls_port


def test_tls_with_a_ca_connects_and_mismatches_fail_with_a_hint(tls_redis, certificates: Path) -> None:
    server, tls_port = tls_redis
    ca = certificates / "ca.crt"
    assert connect(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={ca}", RedisConfig()).ping()
    with pytest.raises(RedisUnavailable, match="if that port speaks TLS, use rediss://"):
        connect(f"redis://127.0.0.1:{tls_port}/0", RedisConfig())
    with pytest.raises(RedisUnavailable, match="if the server speaks plain text, use redis://"):
        connect(f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={ca}", RedisConfig())
    with pytest.raises(RedisUnavailable, match="TLS handshake failed: check the CA"):
        connect(f"rediss://127.0.0.1:{tls_port}/0", RedisConfig())  # no CA: the self-signed chain is refused
