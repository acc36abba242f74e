"""When a sequence stops: shared by the prefill worker (first token) and the decode worker."""

from __future__ import annotations

from core.messages import GenerationTask


def finish_reason(
    task: GenerationTask, token_id: int, num_generated: int, eos_token_ids: tuple[int, ...]
) -> str | None:
    """'stop' on a stop or EOS token, 'length' at max_tokens, else None (keep going)."""
    if token_id in task.stop_token_ids or (not task.ignore_eos and token_id in eos_token_ids):
        return "stop"
    if num_generated >= task.max_tokens:
        return "length"
    return None
