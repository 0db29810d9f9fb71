"""One local[2] Spark session for every audit test module (a session takes seconds to start)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from node.audit import job
from tests.harness.spark import quick_jvm_env


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as env:  # the JVM's alone, not the nodes' and tools'
        for name, value in quick_jvm_env().items():
            env.setenv(name, value)
        session = job.spark_session("local[2]")
    yield session
    session.stop()
