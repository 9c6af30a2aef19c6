"""A real S3-compatible server on 127.0.0.1 for tests: moto's server mode (HTTP, in a thread).

Clients find it the way they would find MinIO or any S3-compatible endpoint: AWS_ENDPOINT_URL,
which pyarrow's S3 filesystem (Ray Train's storage and ours) and boto3 both read.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator


@contextlib.contextmanager
def moto_s3(bucket: str) -> Iterator[dict]:
    """Start the server, create `bucket`, set the environment for this process and its children
    (subprocesses, Ray nodes started afterwards); yields that environment."""
    import boto3  # a missing moto fails the tests that need it: they are not to be skipped
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server._server.server_address[1]
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",  # no 1 s timeouts probing for an instance role
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        boto3.client("s3").create_bucket(Bucket=bucket)
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def s3_keys(bucket: str, prefix: str = "") -> dict[str, int]:
    """{key: size} of every object under `prefix`."""
    import boto3

    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def s3_read(bucket: str, key: str) -> bytes:
    import boto3

    return boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
