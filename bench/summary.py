"""The measures of one run: latency distributions, throughput, failures and SLO goodput."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from bench.client import RequestResult
from bench.load import LoadRun
from bench.stats import Distribution, Slo, attainment


@dataclass(frozen=True)
class Summary:
    """Every measure of one run; latencies in seconds, rates per second of the run's wall time.

    Throughput counts the tokens of completed requests over the whole run (first send to last
    answer). SLO attainment is over every request sent, a failed one counting as missed;
    goodput is the requests within SLO per second.
    """

    completed: int
    failed: int
    unsent: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    input_tokens: int
    output_tokens: int
    ttft_s: Distribution
    tpot_s: Distribution
    itl_s: Distribution
    e2e_s: Distribution
    slo_attainment: float
    goodput_requests_per_s: float
    errors: dict[str, int]  # failure kind -> count


def summarize(run: LoadRun, slo: Slo) -> Summary:
    """The measures of `run`, judged against `slo`."""
    done = [r for r in run.results if r.ok]
    per_second = 1 / run.duration_s if run.duration_s > 0 else 0.0
    good = sum(slo.met(r.ttft_s, r.tpot_s) for r in run.results)
    output_tokens = sum(r.output_tokens for r in done)
    return Summary(
        completed=len(done),
        failed=len(run.results) - len(done),
        unsent=run.unsent,
        duration_s=run.duration_s,
        requests_per_s=len(done) * per_second,
        output_tokens_per_s=output_tokens * per_second,
        input_tokens=sum(_prompt_tokens(r) for r in done),
        output_tokens=output_tokens,
        ttft_s=Distribution.of([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_s=Distribution.of([t for r in done if (t := r.tpot_s) is not None]),
        itl_s=Distribution.of([gap for r in done for gap in r.itl_s]),
        e2e_s=Distribution.of([r.e2e_s for r in done if r.e2e_s is not None]),
        slo_attainment=attainment(slo, [(r.ttft_s, r.tpot_s) for r in run.results]),
        goodput_requests_per_s=good * per_second,
        errors=dict(Counter(error_kind(r.error) for r in run.results if not r.ok)),
    )


def _prompt_tokens(result: RequestResult) -> int:
    """Prompt tokens as the server counted them, else as sent."""
    return result.prompt_tokens if result.prompt_tokens is not None else (result.input_len or 0)


def error_kind(error: str) -> str:
    """The kind of a failure message: its text before the first colon ("HTTP 503", "timeout")."""
    return error.split(":", 1)[0].strip() or "failed"
