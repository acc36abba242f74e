"""Tenant isolation of the prefix cache, probed from outside on the real model: a long prompt
repeated by its tenant is a hit (cached_tokens, and a much shorter TTFT); the same prompt from
another tenant is a miss on both counts; disaggregated (the prefill worker's cache) and
colocated (the decode worker's)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import TEST_CONFIG, Cluster, launch, with_decode_cache

pytestmark = [pytest.mark.e2e, pytest.mark.realmodel]

KEYS = {"alpha": "sk-alpha-0123456789", "beta": "sk-beta-0123456789"}
PROMPT = [100 + (i * 37) % 5000 for i in range(600)]  # 37 full blocks of 16, and 8 tokens more


@pytest.fixture(scope="module", params=[(), ("--colocated", "1")], ids=["p1d1", "colocated"])
def cluster(request: pytest.FixtureRequest, real_model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    flags = [arg for tenant, key in KEYS.items() for arg in ("--api-key", f"{key}:{tenant}")]
    with launch(tmp_path_factory.mktemp("run"), real_model_dir, flags=[*flags, *request.param],
                config=with_decode_cache(TEST_CONFIG), api_key=KEYS["alpha"]) as running:
        yield running


def probe(cluster: Cluster, tenant: str) -> tuple[float, int]:
    """(TTFT in seconds, cached_tokens reported) of PROMPT sent as `tenant`."""
    body = {"model": cluster.model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    started, first, usage = time.monotonic(), None, None
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, headers=headers,
                      timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if first is None and '"text"' in line:
                first = time.monotonic() - started
            if '"usage"' in line and '"prompt_tokens_details"' in line:
                usage = httpx.Response(200, content=line.removeprefix("data: ")).json()["usage"]
    assert first is not None and usage is not None
    return first, usage["prompt_tokens_details"]["cached_tokens"]


def test_a_tenant_hits_its_own_cache_and_never_another_tenants(cluster: Cluster) -> None:
    cold_ttft, cold_cached = probe(cluster, "alpha")
    warm_ttft, warm_cached = probe(cluster, "alpha")
    other_ttft, other_cached = probe(cluster, "beta")
    assert (cold_cached, warm_cached, other_cached) == (0, 592, 0)
    assert warm_ttft < cold_ttft / 2, (cold_ttft, warm_ttft)
    assert other_ttft > 2 * warm_ttft, (other_ttft, warm_ttft)  # computed in full again
    again_ttft, again_cached = probe(cluster, "beta")  # beta's own copy now
    assert again_cached == 592 and again_ttft < other_ttft / 2
    print(f"TTFT ms / cached tokens: alpha cold {cold_ttft * 1000:.0f} / {cold_cached}, "
          f"alpha again {warm_ttft * 1000:.0f} / {warm_cached}, beta {other_ttft * 1000:.0f} / "
          f"{other_cached}, beta again {again_ttft * 1000:.0f} / {again_cached}")
