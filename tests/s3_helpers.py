"""An S3 store for tests: moto's S3 server started here (the default suite), or the store
``DTRAIN_TEST_S3_ENDPOINT`` names (``make test-s3``: OpenStack Swift's S3 API, with its test
account), with a bucket emptied for the module; and ``dtrain`` launched against it. The store's
endpoint and credentials go to the launches' environment only; the test reads the bucket with a
client of its own, given them explicitly."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from dtrain.config import Config
from dtrain.storage.objects import ObjectPath
from dtrain.task import Task, task_config
from dtrain.tasks.gpt import GPTTaskConfig, build
from tests.conftest import REPO

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

KEY_ID = "DTRAINTESTKEYID0001"
SECRET = "dtrain-test-secret-never-written-0001"
BUCKET = "runs"


@dataclass
class Store:
    endpoint: str
    env: dict[str, str]  # what the launches get
    fs: Any  # the test's own client
    secrets: tuple[str, ...]  # what must never be written
    bucket: str = BUCKET

    def path(self, key: str) -> ObjectPath:
        return ObjectPath(f"s3://{self.bucket}/{key}", self.fs)


def silent_store() -> Any:
    """A client of a store that does not answer: a port nothing listens on, where each request
    is refused, retried, and given up."""
    gone = s3fs.S3FileSystem(
        key=KEY_ID,
        secret=SECRET,
        endpoint_url="http://127.0.0.1:9",
        config_kwargs={"retries": {"max_attempts": 1, "mode": "standard"}},
        skip_instance_cache=True,
    )
    gone.retries = 1
    return gone


def open_store(bucket: str = BUCKET) -> Iterator[Store]:
    """A module's store (its fixture yields from this), with ``bucket`` made or emptied: one
    bucket per test module, so that modules run at once on one store keep apart."""
    server = None
    endpoint = os.environ.get("DTRAIN_TEST_S3_ENDPOINT", "")
    key, secret = ("test:tester", "testing") if endpoint else (KEY_ID, SECRET)  # Swift's
    if not endpoint:
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
    env = {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    fs = s3fs.S3FileSystem(key=key, secret=secret, endpoint_url=endpoint, use_listings_cache=False)
    if fs.exists(bucket):  # a store kept from an earlier run (make test-s3): start clean
        for name in fs.find(bucket):
            fs.rm_file(name)  # one by one: Swift refuses botocore's multi-object delete
    else:
        fs.mkdir(bucket)
    yield Store(endpoint, env, fs, (key, secret), bucket)
    if server is not None:
        server.stop()


def dtrain(store: Store, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "dtrain", *args],
        cwd=REPO,
        env={**os.environ, **store.env, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out + err


# The step at which rank 0 of a launch of preempted_gpt sends SIGTERM to its launcher.
SIGTERM_AT_STEP_ENV = "DTRAIN_TEST_SIGTERM_AT_STEP"


@task_config(GPTTaskConfig)
def preempted_gpt(cfg: Config) -> Task:
    """The default task, whose rank 0 sends SIGTERM to its launcher (its parent: torch's agent
    runs in it) as step N starts, when the launch's environment sets ``SIGTERM_AT_STEP_ENV``
    to N: a preemption at a known step. The launch after it, without the variable, resumes."""
    import signal

    from dtrain.fault.failpoints import set_handler

    step = int(os.environ.get(SIGTERM_AT_STEP_ENV, "0"))
    if step and os.environ.get("RANK") == "0":

        def on_failpoint(name: str, **args: Any) -> None:
            if name == "train.step" and args["step"] == step:
                os.kill(os.getppid(), signal.SIGTERM)

        set_handler(on_failpoint)
    return build(cfg)
