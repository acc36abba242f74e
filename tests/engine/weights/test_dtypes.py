"""model.dtype as config names it: auto resolves by what this CPU multiplies fast, without torch."""

from __future__ import annotations

import pytest

from engine.kernels.isa import native_bf16
from engine.weights.dtypes import resolve_dtype


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_a_named_dtype_is_kept(name: str) -> None:
    assert resolve_dtype(name) == name


def test_auto_is_bf16_only_where_the_cpu_multiplies_bf16() -> None:
    assert resolve_dtype("auto") == ("bfloat16" if native_bf16() else "float32")


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="must be auto or one of"):
        resolve_dtype("fp8")
