"""model.dtype as config names it: auto resolves by what this CPU multiplies fast."""

from __future__ import annotations

import pytest

from engine.linear import fast_bf16
from engine.loading import model_dtype


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_a_named_dtype_is_kept(name: str) -> None:
    assert model_dtype(name) == name


def test_auto_is_bf16_only_where_bf16_is_fast() -> None:
    assert model_dtype("auto") == ("bfloat16" if fast_bf16() else "float32")


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="must be auto or one of"):
        model_dtype("fp8")

