from __future__ import annotations

import pytest

from kvwake.store import Store
from tests.kvdata import BUNDLE, OTHER_BUNDLE


@pytest.fixture
def store(tmp_path):
    """A fresh store with 4-token blocks and both test bundles registered."""
    s = Store(tmp_path / "store", block_tokens=4)
    s.register_bundle(BUNDLE, {"model": "test-a"})
    s.register_bundle(OTHER_BUNDLE, {"model": "test-b"})
    yield s
    s.close()
