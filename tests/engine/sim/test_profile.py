"""Sim profiles: the latency model's arithmetic, and the profiles shipped in configs/sim."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model.batch import ForwardBatch
from engine.sim.profile import PROFILES_DIR, Latency, load_profile, parse_profile

LATENCY = Latency(prefill_ms=10, prefill_ms_per_token=0.5, prefill_ms_per_token_context=0.01,
                  decode_ms=5, decode_ms_per_sequence=0.25, decode_ms_per_context_token=0.001)


def test_a_prefill_chunk_pays_its_tokens_and_the_keys_they_attend_to() -> None:
    batch = ForwardBatch([[1] * 100], [300], [list(range(25))])
    keys = 100 * 300 + 100 * 101 // 2
    assert LATENCY.step_s(batch) == pytest.approx((10 + 0.5 * 100 + 0.01 * keys) / 1e3)


def test_a_decode_step_pays_its_batch_and_contexts_and_a_mixed_step_both() -> None:
    decode = ForwardBatch([[1], [2]], [99, 199], [[0] * 7, [1] * 13])
    assert LATENCY.step_s(decode) == pytest.approx((5 + 0.25 * 2 + 0.001 * 300) / 1e3)
    mixed = ForwardBatch([[1], [2] * 4], [99, 0], [[0] * 7, [1]])
    assert LATENCY.step_s(mixed) == pytest.approx(
        (10 + 0.5 * 4 + 0.01 * 10) / 1e3 + (5 + 0.25 + 0.001 * 100) / 1e3)


def test_negative_terms_are_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        Latency(decode_ms=-1)


@pytest.mark.parametrize("path", sorted(PROFILES_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_profile_loads_and_says_where_it_was_measured(path: Path) -> None:
    profile = load_profile(path.stem)
    assert profile.name == path.stem
    assert "python -m bench calibrate" in profile.source
    assert profile.fit_error and max(profile.fit_error.values()) < 50


def test_the_default_profile_is_shipped() -> None:
    assert (PROFILES_DIR / "default.yaml").is_file()


def test_unknown_profiles_and_keys_are_named() -> None:
    with pytest.raises(ValueError, match=r"no sim profile 'nope'.*default"):
        load_profile("nope")
    with pytest.raises(ValueError, match=r"unknown keys.*speed"):
        parse_profile("name: x\nsource: y\nspeed: 3\nshape: {}\nlatency: {}\n", "here")
