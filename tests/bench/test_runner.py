"""The runner microbenchmark on the tiny model: every figure, for both implementations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.runner import OursBackend, RunnerPlan, TransformersBackend, run


def test_runner_figures_on_the_tiny_model(tiny_model_dir: Path) -> None:
    plan = RunnerPlan(prefill_lens=(16, 40), batch_sizes=(1, 3), context=20, repeats=1, steps=2)
    seen: list[str] = []
    results = run(tiny_model_dir, plan, lambda n: list(range(100, 100 + n)), seen.append)
    assert len(seen) == 2 * (2 + 2)
    for figures in (results.ours, results.transformers):
        assert set(figures.prefill_tokens_per_s) == {16, 40}
        assert set(figures.decode_step_s) == {1, 3}
        assert all(v > 0 for v in (*figures.prefill_tokens_per_s.values(),
                                   *figures.decode_step_s.values()))
    assert results.same_next_token
    speedup = results.decode_speedup()[3]
    ours, theirs = results.ours.decode_step_s[3], results.transformers.decode_step_s[3]
    assert speedup == pytest.approx(theirs / ours)


def test_both_backends_decode_the_same_greedy_tokens(tiny_model_dir: Path) -> None:
    """The timed decode steps compute the same thing in both: same logits after a prefill."""
    plan = RunnerPlan(prefill_lens=(8,), batch_sizes=(2,), context=8, repeats=1, steps=2)
    ours = OursBackend(tiny_model_dir, plan)
    theirs = TransformersBackend(tiny_model_dir, torch.float32)
    ids = [5, 17, 300, 42, 9, 1000, 77, 3]
    assert ours.prefill(ids).argmax() == theirs.prefill(ids).argmax()
    torch.testing.assert_close(ours.prefill(ids), theirs.prefill(ids), atol=1e-3, rtol=1e-3)
    assert len(ours.decode_times(2, ids, 2)) == len(theirs.decode_times(2, ids, 2)) == 2
    assert ours.runner.allocator.num_free == ours.runner.allocator.num_total  # blocks freed


def test_bf16_plan_runs_both_sides_in_bf16(tiny_model_dir: Path) -> None:
    plan = RunnerPlan(prefill_lens=(8,), batch_sizes=(2,), context=8, repeats=1, steps=1,
                      dtype="bfloat16")
    ours = OursBackend(tiny_model_dir, plan)
    theirs = TransformersBackend(tiny_model_dir, torch.bfloat16)
    assert ours.runner.cache.dtype == torch.bfloat16
    assert next(theirs.model.parameters()).dtype == torch.bfloat16


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="dtype"):
        RunnerPlan(dtype="float8")
