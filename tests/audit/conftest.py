"""One local[2] Spark session for every audit test module (a session takes seconds to start)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from node.audit import job


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    session = job.spark_session("local[2]")
    yield session
    session.stop()
