"""The sim profile's fit: exact on steps the model describes, never a negative term."""

from __future__ import annotations

import pytest

from bench.calibrate import Step, fit, fit_profile
from engine.sim.profile import Latency

SHAPE = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "hidden_size": 64, "intermediate_size": 128}


def steps_of(latency: Latency) -> list[Step]:
    prefill = [Step("prefill", n, c, 0.0) for n in (16, 128, 512) for c in (0, 1024)]
    decode = [Step("decode", b, c, 0.0) for b in (1, 8, 64) for c in (64, 2048)]
    timed = []
    for step in prefill + decode:
        _, size, keys = step.features()
        seconds = (latency.prefill_s(int(size), int(keys)) if step.kind == "prefill"
                   else latency.decode_s(int(size), int(keys)))
        timed.append(Step(step.kind, step.size, step.context, seconds * 1e3))
    return timed


def test_steps_the_model_describes_are_fitted_exactly() -> None:
    truth = Latency(12.0, 0.2, 0.0003, 8.0, 0.5, 0.001)
    profile = fit_profile("x", "here", SHAPE, steps_of(truth), "bfloat16")
    assert profile.latency.prefill_ms_per_token == pytest.approx(0.2, rel=1e-3)
    assert profile.latency.decode_ms_per_context_token == pytest.approx(0.001, rel=1e-3)
    assert max(profile.fit_error.values()) < 0.1


def test_a_term_the_steps_would_make_negative_is_dropped() -> None:
    steps = [Step("decode", b, 100, 1.0 * b - 0.5) for b in (1, 2, 4, 8)]
    intercept, per_sequence, per_context = fit(steps)
    assert intercept == 0 and per_sequence > 0 and per_context >= 0
