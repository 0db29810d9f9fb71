"""A real single-member etcd on free loopback ports for the tests: node/localcluster.py's
launcher (one copy), which fails naming `make tools` when etcd is not installed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from node.localcluster import EtcdProcess

EtcdServer = EtcdProcess


@contextmanager
def running_etcd(work_dir: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(work_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
