"""Shared fixtures: the real prepared model and tiny random Llama models built in seconds."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import xgrammar as xgr
import zmq
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from core.process import freeze_start_up
from engine.kernels.cpu.build import build_problem, chosen_isa, has_compiler, kernels, use_isa
from engine.kernels.isa import cpu_flags, runnable_levels
from engine.locate import resolve_model
from engine.sampling.grammar import Grammars
from engine.weights.files import EMBED
from engine.weights.quant_blocks import dequantize, quantize, write_quant_blocks
from engine.weights.tokenizer import load_tokenizer

REAL_MODEL = "SmolLM2-135M-Instruct"
MODEL_CACHE_DIR = "~/.cache/raging/models"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
)
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 49152,  # the real tokenizer's, so its files can be reused
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    # Large weights spread the logits, so greedy argmax is never decided by float noise.
    "initializer_range": 0.2,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


@pytest.fixture(autouse=True)
def same_cpus_and_threads() -> Iterator[None]:
    """No test leaves this process on other CPUs or with other torch threads: every later test,
    and every process it starts, would inherit them (a benchmark pinned the whole suite to one
    CPU once, and libgomp in the clusters it started stopped spinning)."""
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    yield
    assert os.sched_getaffinity(0) == cpus, "the test left this process on other CPUs"
    assert torch.get_num_threads() == threads, "the test left torch on other threads"


_GRAMMAR_TABLES: dict[tuple[str, int], Any] = {}


@pytest.fixture
def shared_grammar_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers made in this process, dozens a module, build their grammar tables once per
    tokenizer and vocabulary (a worker process builds them once in its life anyway; each
    build holds the GIL ~0.6 s), each with a compiler of its own."""
    build = Grammars._build_tables

    def shared(grammars: Grammars) -> Any:
        files = [Path(grammars.model_dir) / name for name in TOKENIZER_FILES]
        if not files[0].exists():
            return build(grammars)
        key = (hashlib.sha256(b"".join(f.read_bytes() for f in files if f.exists())).hexdigest(),
               grammars.vocab_size)
        if key not in _GRAMMAR_TABLES:
            _GRAMMAR_TABLES[key] = build(grammars)
        tables = _GRAMMAR_TABLES[key]
        return dataclasses.replace(tables, compiler=xgr.GrammarCompiler(
            tables.tokenizer_info, max_threads=1, cache_enabled=False))

    monkeypatch.setattr(Grammars, "_build_tables", shared)


DEFAULT_FUZZ_EXAMPLES = 1500
DEFAULT_CLUSTER_FUZZ_EXAMPLES = 150


def require_kernels() -> ModuleType:
    """The C++ kernels; a skip only where no C++ compiler could build them, a failure where one
    is here and the build failed."""
    module = kernels()
    if module is not None:
        return module
    if not has_compiler():
        pytest.skip("no C++ compiler here: torch's ops serve instead")
    pytest.fail(f"the C++ kernels failed to build with this machine's compiler: {build_problem()}")


@pytest.fixture(scope="session")
def cpu_kernels() -> ModuleType:
    """The compiled C++ kernels (see `require_kernels`)."""
    return require_kernels()


RUNNABLE_ISAS = [level.name for level in runnable_levels(cpu_flags())]


@pytest.fixture(params=RUNNABLE_ISAS)
def every_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each instruction-set level this CPU runs, in turn: the kernels are built for it and
    used by everything the test calls; the level chosen before is restored after."""
    before = chosen_isa()
    use_isa(request.param)
    try:
        require_kernels()
        yield request.param
    finally:
        use_isa(before.name)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked `kernels` need the C++ kernels (see `require_kernels`)."""
    if item.get_closest_marker("kernels") is not None:
        require_kernels()


BUILD_EVERY_LEVEL = """
import os, sys
os.nice(19)  # the tests go first: the builds take the CPU time they leave idle
from engine.kernels.cpu.build import kernels_at
from engine.kernels.isa import LEVELS
for level in LEVELS:
    if level.name in sys.argv[1:]:
        kernels_at(level)
"""
_level_builds: list[subprocess.Popen[bytes]] = []


def start_level_builds(items: list[pytest.Item]) -> None:
    """Where tests run at every level, each level's kernels are built from the session's start
    in a process of their own at nice 19 (a build holds both CPUs ~30 s; the suite leaves
    them a third idle), each under the lock a build of the test's own would wait on. The
    process stays in the suite's session: in a session of its own, Linux's autogroups would
    weigh it as the suite's equal, nice or not (a spinning-threads test then failed)."""
    if has_compiler() and any("every_isa" in getattr(item, "fixturenames", ()) for item in items):
        _level_builds.append(subprocess.Popen(
            [sys.executable, "-c", BUILD_EVERY_LEVEL, *RUNNABLE_ISAS], process_group=0,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "MAX_JOBS": "2"}))


def stop_level_builds() -> None:
    """A build still running is ended, its compilers with it (SIGTERM: ninja removes what
    they left half written)."""
    for process in _level_builds:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture
def quiet_cpus() -> Iterator[None]:
    """The level builds paused (SIGSTOP to their process group) while a test measures how
    threads share the CPUs: at nice 19 a compiler still takes turns on them now and then."""
    running = [process for process in _level_builds if process.poll() is None]
    for process in running:
        os.killpg(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for process in running:
            os.killpg(process.pid, signal.SIGCONT)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collecting built (torch, transformers, every module under test) lives all session:
    frozen, no collection walks it again (the gateway's tests took 6 % less time)."""
    freeze_start_up()
    start_level_builds(session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    stop_level_builds()
    gc.unfreeze()  # collected at exit as usual (frozen, nanobind's objects are reported leaked)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz-examples", type=int, default=DEFAULT_FUZZ_EXAMPLES, metavar="N",
        help=f"examples per hypothesis fuzz test (default {DEFAULT_FUZZ_EXAMPLES})",
    )
    parser.addoption(
        "--cluster-fuzz-examples", type=int, default=DEFAULT_CLUSTER_FUZZ_EXAMPLES, metavar="N",
        help="examples per strategy against a running cluster "
             f"(default {DEFAULT_CLUSTER_FUZZ_EXAMPLES})",
    )


@pytest.fixture(scope="session")
def fuzz_examples(request: pytest.FixtureRequest) -> int:
    """How many examples each fuzz test tries (`--fuzz-examples`)."""
    return int(request.config.getoption("--fuzz-examples"))


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    """A ZeroMQ context of the test's own, destroyed after it."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(scope="session")
def cluster_fuzz_examples(request: pytest.FixtureRequest) -> int:
    """How many bodies each strategy sends to a running cluster (`--cluster-fuzz-examples`)."""
    return int(request.config.getoption("--cluster-fuzz-examples"))


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The prepared SmolLM2-135M-Instruct folder (fp32 safetensors, tokenizer, chat template)."""
    return resolve_model(REAL_MODEL, MODEL_CACHE_DIR)


def with_tokenizer(folder: Path, real_model_dir: Path) -> None:
    """The real model's tokenizer files (and chat template) copied into a model `folder`."""
    for name in TOKENIZER_FILES:
        if (real_model_dir / name).exists():
            shutil.copy(real_model_dir / name, folder / name)


@pytest.fixture(scope="session")
def make_tiny_model(
    real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    """Factory: a tiny random Llama folder; keyword arguments override its LlamaConfig."""

    def make(**overrides: Any) -> Path:
        folder = tmp_path_factory.mktemp("tiny-llama")
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, **overrides}))
        model.save_pretrained(folder)
        with_tokenizer(folder, real_model_dir)
        return folder

    return make


@pytest.fixture(scope="session")
def tiny_qwen2_dir(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Qwen2 (the tiny Llama's sizes, untied embeddings, q/k/v biases drawn
    large enough to count: transformers starts them at zero) with the real tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{**TINY_CONFIG, "tie_word_embeddings": False,
                                            "rope_theta": 1000000.0}))
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                               layer.self_attn.v_proj):
                projection.bias.normal_(0, 0.5)
    model.save_pretrained(folder)
    with_tokenizer(folder, real_model_dir)
    return folder


@pytest.fixture(scope="session")
def tiny_qwen3_dir(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Qwen3 (the tiny Llama's sizes but heads of 32, wider than hidden /
    heads; untied embeddings; q and k norms drawn away from one, where transformers starts
    them) with the real tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen3")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**{**TINY_CONFIG, "tie_word_embeddings": False,
                                            "head_dim": 32, "rope_theta": 1000000.0}))
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.normal_(1, 0.5)
    model.save_pretrained(folder)
    with_tokenizer(folder, real_model_dir)
    return folder


@pytest.fixture(scope="session")
def tiny_qwen3_embedding_dir(tiny_qwen3_dir: Path, real_model_dir: Path,
                             tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3's decoder alone, as embedding models ship (Qwen3-Embedding-8B's): its
    weights named without `model.`, no output head, embeddings not tied."""
    from transformers import Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen3-embedding")
    Qwen3ForCausalLM.from_pretrained(tiny_qwen3_dir).model.save_pretrained(folder)
    with_tokenizer(folder, real_model_dir)
    return folder


@pytest.fixture(scope="session")
def tiny_mistral_dir(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Mistral (the tiny Llama's sizes) whose sliding window of 8 keys is
    shorter than the prompts tests give it, with the real tokenizer."""
    from transformers import MistralConfig, MistralForCausalLM

    folder = tmp_path_factory.mktemp("tiny-mistral")
    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(**TINY_CONFIG, sliding_window=8)).save_pretrained(folder)
    with_tokenizer(folder, real_model_dir)
    return folder


# Qwen2.5-Coder's fill-in-the-middle tokens, in its order.
FILL_TOKENS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>")


@pytest.fixture(scope="session")
def tiny_coder_dir(make_tiny_model: Callable[..., Path], real_model_dir: Path) -> Path:
    """The tiny Llama as a code model: Qwen2.5-Coder's fill-in-the-middle tokens added to the
    real tokenizer (as its vocabulary's last ids; not special, as it ships them), with rows of
    their own."""
    folder = make_tiny_model(vocab_size=TINY_CONFIG["vocab_size"] + len(FILL_TOKENS))
    tokenizer = load_tokenizer(real_model_dir)
    assert tokenizer.add_tokens(list(FILL_TOKENS), special_tokens=False) == len(FILL_TOKENS)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_model: Callable[..., Path]) -> Path:
    """A 2-layer random Llama (hidden 64, 4 heads, 2 kv heads) with the real tokenizer."""
    return make_tiny_model()


@pytest.fixture(scope="session")
def quant_model_dir(make_tiny_model: Callable[..., Path]) -> Path:
    """The tiny Llama as a GGUF would ship it: its layers' matrices rounded to 4-bit quant
    blocks, its embedding to 8-bit ones, saved dequantized, with the quant file written."""
    folder = make_tiny_model()
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name, tensor in tensors.items():
        if tensor.dim() == 2:
            tensors[name] = dequantize(quantize(tensor, 8 if name == EMBED else 4))
    save_file(tensors, path, metadata={"format": "pt"})
    write_quant_blocks(folder)
    return folder
