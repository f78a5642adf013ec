"""Fixtures shared by every suite. Keep this file small: suites own their fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import settings

# Examples take microseconds; hypothesis's default 200 ms deadline only ever trips on a stalled
# core of a shared 2-core CI machine, which is no property violation.
settings.register_profile("prefixroute", deadline=None)
settings.load_profile("prefixroute")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # so suites can import tests.helpers
    sys.path.insert(0, str(ROOT))

from tests.helpers.tiny_tokenizer import make_tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer directory trained here (tests/helpers/tiny_tokenizer.py):
    tokenizer.json with a BOS post-processor, tokenizer_config.json with the one-line-per-message
    chat template of scripts/make_tiny_model.py."""
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))
