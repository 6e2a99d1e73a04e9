"""A real S3-compatible server for the tests: ``moto_server`` (moto's standalone server, a
test dependency) in its own process on a free loopback port, with request authentication on.

moto checks credentials only once its first ``INITIAL_NO_AUTH_ACTION_COUNT`` requests are
served; the server is started with that count at 3 and those three requests create an IAM user,
its access key and a policy allowing it every S3 and IAM action (so tests can make more users
and deny them actions: :meth:`S3Server.new_user`, :meth:`S3Server.deny`). From then on every
request must carry a SigV4 signature that moto recomputes (with botocore) and compares, and an
access key moto knows: a wrong secret is ``SignatureDoesNotMatch``, an unknown key
``InvalidAccessKeyId``. boto3 (moto's own dependency) does the bootstrap and the tests'
look-ups into the bucket; the gateway never uses it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

REGION = "us-east-1"
NO_AUTH_BOOTSTRAP_REQUESTS = 3  # create user, create access key, put user policy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """One ``moto_server`` process; ``access_key_id``/``secret_access_key`` are a key it
    accepts, available after :meth:`start`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.access_key_id = ""
        self.secret_access_key = ""

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        beside = Path(sys.executable).with_name("moto_server")  # the venv's, else PATH's
        binary = beside if beside.exists() else Path(shutil.which("moto_server") or beside)
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(NO_AUTH_BOOTSTRAP_REQUESTS)}
        with (self.workdir / "moto.log").open("wb") as log:
            self.proc = subprocess.Popen(
                [str(binary), "-H", "127.0.0.1", "-p", str(self.port)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited {self.proc.returncode}")
            try:
                httpx.get(self.url + "/moto-api/", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise RuntimeError("moto_server did not start in 60 s")
        self._bootstrap()

    def _bootstrap(self) -> None:
        iam = self.client("iam", "bootstrap", "bootstrap")
        iam.create_user(UserName="portico")
        key = iam.create_access_key(UserName="portico")["AccessKey"]
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": ["s3:*", "iam:*"], "Resource": "*"}],
        }
        iam.put_user_policy(UserName="portico", PolicyName="s3", PolicyDocument=json.dumps(policy))
        self.access_key_id = key["AccessKeyId"]
        self.secret_access_key = key["SecretAccessKey"]

    def new_user(self) -> tuple[str, str, str]:
        """Another IAM user allowed every S3 action: (user name, key id, secret)."""
        iam = self.client("iam")
        name = f"user-{uuid.uuid4().hex[:8]}"
        iam.create_user(UserName=name)
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName=name, PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return name, key["AccessKeyId"], key["SecretAccessKey"]

    def deny(self, user: str, actions: list[str] | None) -> None:
        """Deny ``user`` these S3 actions (an explicit Deny wins over the Allow); None lifts it."""
        iam = self.client("iam")
        if actions is None:
            iam.delete_user_policy(UserName=user, PolicyName="deny")
            return
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Deny", "Action": actions, "Resource": "*"}],
        }
        iam.put_user_policy(UserName=user, PolicyName="deny", PolicyDocument=json.dumps(policy))

    def client(self, service: str = "s3", key_id: str = "", secret: str = "") -> Any:
        """A boto3 client of this server (the accepted key unless one is given)."""
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id=key_id or self.access_key_id,
            aws_secret_access_key=secret or self.secret_access_key,
        )

    def new_bucket(self) -> str:
        name = f"portico-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def objects(self, bucket: str) -> dict[str, bytes]:
        """Every object in ``bucket``: key -> bytes."""
        s3 = self.client()
        listed = s3.list_objects_v2(Bucket=bucket).get("Contents", [])
        return {o["Key"]: s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}

    def store_config(self, bucket: str, **overrides: Any) -> dict[str, Any]:
        """``batches.store`` for ``bucket`` on this server."""
        return {
            "kind": "s3",
            "endpoint_url": self.url,
            "bucket": bucket,
            "region": REGION,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
            **overrides,
        }

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
