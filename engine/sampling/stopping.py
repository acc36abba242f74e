"""When a sequence stops: shared by the prefill worker (first token) and the decode worker."""

from __future__ import annotations

from core.messages import FinishReason, GenerationTask


def finish_reason(
    task: GenerationTask, token_id: int, num_generated: int, eos_token_ids: tuple[int, ...]
) -> FinishReason | None:
    """'stop' on a stop or EOS token past min_tokens, 'length' at max_tokens, else None.

    `num_generated` counts this epoch's tokens, `token_id` included."""
    if token_id in stop_tokens(task, eos_token_ids) and (
            task.output_before + num_generated > task.min_tokens):
        return "stop"
    if num_generated >= task.max_tokens:
        return "length"
    return None


def banned_tokens(
    task: GenerationTask, num_generated: int, eos_token_ids: tuple[int, ...]
) -> tuple[int, ...]:
    """The tokens the next draw may not pick: every stop token (EOS too, unless ignored) while
    fewer than min_tokens are generated (vLLM's min_tokens). `num_generated` counts this
    epoch's tokens before the draw."""
    if task.output_before + num_generated >= task.min_tokens:
        return ()
    return stop_tokens(task, eos_token_ids)


def stop_tokens(task: GenerationTask, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The tokens that end the sequence: its stop_token_ids, and EOS unless ignore_eos."""
    eos = () if task.ignore_eos else eos_token_ids
    return (*task.stop_token_ids, *eos)
