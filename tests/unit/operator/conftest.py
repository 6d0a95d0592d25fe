"""Fixtures for the operator's unit tests: a real HTTP origin on 127.0.0.1 to stage from.

No torch here or in anything the operator's unit tests import (tests/unit/test_layout.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.origin import Origin


@pytest.fixture
def origin() -> Iterator[Origin]:
    # Plain http on loopback: tests build HttpsSource directly; parse_source's https-only rule
    # is tested on its own in test_sources.py.
    server = Origin()
    try:
        yield server
    finally:
        server.close()
