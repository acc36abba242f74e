"""Fixtures the end-to-end tests share: the tiny model's tokenizer and greedy reference, and the
real-model clusters of the modules that define none of their own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.e2e.cluster import (
    REAL_LAUNCH_S,
    TEST_CONFIG,
    Cluster,
    alive,
    greedy_reference,
    launch,
    wait_for,
)

E2E = Path(__file__).parent


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Callable[[list[int], int], list[int]]:
    """Greedy continuation of the tiny model by transformers itself."""
    return greedy_reference(tiny_model_dir)


class SharedClusters:
    """The real-model clusters (1 gateway + 1 prefill + 1 decode, TEST_CONFIG) that modules
    without a `cluster` of their own share, one per context length: each starts when a module
    first needs it and stops after the last one that does (a start is ~5 s of both CPUs)."""

    def __init__(self, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.model_dir = model_dir
        self.tmp_path_factory = tmp_path_factory
        self.running: dict[int | None, tuple[Cluster, ExitStack]] = {}

    def get(self, context: int | None) -> Cluster:
        """The cluster of `context` tokens (None: the model's own), idle, as the module before
        must leave it."""
        if context not in self.running:
            config = TEST_CONFIG if context is None else {
                **TEST_CONFIG, "model": {**TEST_CONFIG["model"], "max_model_len": context}}
            stack = ExitStack()
            cluster = stack.enter_context(launch(
                self.tmp_path_factory.mktemp("run"), self.model_dir, config=config,
                timeout_s=REAL_LAUNCH_S))
            self.running[context] = cluster, stack
        cluster = self.running[context][0]
        assert all(map(alive, cluster.pids().values())), cluster.pids()
        wait_for(lambda: cluster.idle() and cluster.idle("prefill-0"), 10,
                 "the shared cluster to be left idle")
        return cluster

    def stop(self, context: int | None) -> None:
        self.running.pop(context)[1].close()

    def close(self) -> None:
        for context in list(self.running):
            self.stop(context)


def context_of(module: object) -> int | None:
    """The context length a module's shared cluster has (its `CLUSTER_CONTEXT`, if it sets
    one)."""
    return getattr(module, "CLUSTER_CONTEXT", None)


def on_a_shared_cluster(item: pytest.Item) -> bool:
    """Whether the test `item` runs on a shared cluster (an end-to-end test whose module
    defines no `cluster`)."""
    module = getattr(item, "module", None)
    return (item.path.is_relative_to(E2E) and "cluster" in getattr(item, "fixturenames", ())
            and module is not None and "cluster" not in vars(module))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules on one shared cluster run one after another, from where the first of them
    stands, so that the cluster runs only while they do (idle, it still takes ~3 % of a CPU)."""
    sharing = {getattr(item, "module", None) for item in items if on_a_shared_cluster(item)}
    first: dict[int | None, int] = {}
    for index, item in enumerate(items):
        if (module := getattr(item, "module", None)) in sharing:
            first.setdefault(context_of(module), index)

    def place(indexed: tuple[int, pytest.Item]) -> tuple[int, int]:
        index, item = indexed
        module = getattr(item, "module", None)
        return (first[context_of(module)], index) if module in sharing else (index, 0)

    items[:] = [item for _, item in sorted(enumerate(items), key=place)]


@pytest.fixture(scope="session")
def shared_clusters(real_model_dir: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedClusters]:
    clusters = SharedClusters(real_model_dir, tmp_path_factory)
    try:
        yield clusters
    finally:
        clusters.close()


@pytest.fixture(scope="module")
def cluster(shared_clusters: SharedClusters, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The module's real-model cluster, shared with the other modules that ask for the same
    context (see `SharedClusters`): its context is the module's `CLUSTER_CONTEXT` tokens where
    it sets one (a test that fills the context then prefills it in seconds). A module that
    needs another cluster defines its own `cluster`."""
    context = context_of(request.module)
    yield shared_clusters.get(context)
    items = request.session.items
    last = max(i for i, item in enumerate(items) if getattr(item, "module", None) is request.module)
    if not any(on_a_shared_cluster(item) and context_of(getattr(item, "module", None)) == context
               for item in items[last + 1:]):
        shared_clusters.stop(context)


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    """The official client of the module's `cluster`."""
    with cluster.openai_client() as made:
        yield made
