from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.crash.nodeproc import NodeProcess


@pytest.fixture(autouse=True)
def reap_nodes() -> Iterator[None]:
    """No node process outlives its test, whatever the test's outcome."""
    yield
    while NodeProcess.started:
        NodeProcess.started.pop().kill()
