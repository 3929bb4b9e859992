"""This package's fixtures: the default model's tokenizer, which the grammars compile for."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="package")
def tokenizer() -> Any:
    from kvserve.transformers_utils.model_resolver import resolve_model
    from kvserve.transformers_utils.tokenizer import get_tokenizer

    return get_tokenizer(resolve_model(None))
