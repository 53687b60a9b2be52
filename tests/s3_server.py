"""An S3 API server (moto) on 127.0.0.1 for the tests: no cloud account, nothing off the machine.

pyarrow, boto3 and every Ray worker started after `moto_s3()` is entered find it the standard way,
through `AWS_ENDPOINT_URL_S3` and the `AWS_*` credentials it puts in the environment.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

BUCKET = "raytorch-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_s3(bucket: str = BUCKET) -> Iterator[str]:
    """An S3 server on a free 127.0.0.1 port with one bucket; yields `s3://<bucket>`.

    The AWS_* variables are set for its lifetime and restored afterwards.
    """
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        boto3.client("s3").create_bucket(Bucket=bucket)
        yield f"s3://{bucket}"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()
