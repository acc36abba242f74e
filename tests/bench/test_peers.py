"""The peers benchmark's pure parts: the peers' commands, the Hugging Face folder vLLM is given,
install stamps, kernel ISAs from /metrics, the per-run prompts, the table, ratios and plot; and
stopping a peer's whole process group."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from PIL import Image

from bench import peers
from bench.client import RequestResult
from bench.load import Load, LoadRun
from bench.peers import (
    PeerServer,
    add_parser,
    cpu_info,
    cpus_arg,
    hf_folder,
    install_once,
    is_installed,
    kernel_isa,
    llamacpp_key,
    llamacpp_server,
    peers_plan,
    process_tree,
    serving,
    stamp_key,
    vllm_server,
)
from bench.plots import plot_peers
from bench.prompts import TextPrompts
from bench.report import peers_json, peers_markdown, peers_summary, write_json
from bench.results import CpuInfo, Measured, PeerInfo, PeersResults, ServeResults, TargetResults
from bench.serve import Plan
from bench.stats import Slo
from bench.summary import summarize
from bench.workloads import RequestSpec, Workload
from engine.weights.files import QUANT_FILE, QUANT_ROWS_FILE, READY_MARKER


def _parse(*words: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["peers", *words])


def test_vllm_command_pins_the_cpus_and_serves_the_folder_in_float32() -> None:
    server = vllm_server(Path("/p/venv"), Path("/p/models/M"), "M", 8123, (0, 1))
    assert server.command[:3] == ("taskset", "-c", "0-1")
    assert server.command[3:6] == ("/p/venv/bin/python", "-m",
                                   "vllm.entrypoints.openai.api_server")
    words = server.command[3:]
    assert words[words.index("--model") + 1] == "/p/models/M"
    assert words[words.index("--dtype") + 1] == "float32"
    assert words[words.index("--served-model-name") + 1] == "M"
    assert words[words.index("--port") + 1] == "8123"
    assert server.env == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    assert server.url == "http://127.0.0.1:8123" and server.label == "vllm-cpu"
    assert server.version == peers.VLLM_PACKAGE.split("==")[1]


def test_with_torch_capped_at_avx2_vllm_runs_its_avx2_kernels_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # for the check below
    server = vllm_server(Path("/p/venv"), Path("/p/models/M"), "M", 8123, (0, 1), avx2=True)
    assert server.env["PYTHONPATH"] == str(peers.VLLM_AVX2)
    env = peers.peer_env(server.env)
    seen = subprocess.run(  # what vLLM's kernel choice reads, under that environment
        [sys.executable, "-c", "import torch; print(torch.cpu._is_avx512_supported(), "
         "torch.cpu._is_avx512_bf16_supported())"], env=env, capture_output=True, text=True,
        check=True, timeout=120).stdout.split()
    assert seen == ["False", "False"]


def test_llamacpp_command_has_a_slot_per_stream_and_a_thread_per_cpu() -> None:
    server = llamacpp_server(Path("/b/llama-server"), Path("/m/x.gguf"), "M", 9000,
                             (0, 1, 3), slots=32)
    assert server.command[:4] == ("taskset", "-c", "0-1,3", "/b/llama-server")
    words = server.command[4:]
    assert words[words.index("-m") + 1] == "/m/x.gguf"
    assert words[words.index("--alias") + 1] == "M"
    assert words[words.index("-t") + 1] == words[words.index("-tb") + 1] == "3"
    assert words[words.index("-np") + 1] == "32"
    assert words[words.index("-c") + 1] == str(32 * 512)
    assert "--cont-batching" in words and "--jinja" in words
    assert server.env == {} and server.serves == "/m/x.gguf"


def test_cpu_lists() -> None:
    assert cpus_arg("0-1,3") == (0, 1, 3)
    assert cpus_arg("2") == (2,)
    for bad in ("", ",", "a", "1-x", "-1", "3-1"):
        with pytest.raises(ValueError):
            cpus_arg(bad)


def test_peer_environment_is_offline_and_without_our_paths(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/repo")
    monkeypatch.setenv("VIRTUAL_ENV", "/repo/.venv")
    env = peers.peer_env({"VLLM_CPU_KVCACHE_SPACE": "2"})
    assert "PYTHONPATH" not in env and "VIRTUAL_ENV" not in env
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["PATH"] == os.environ["PATH"]


def _prepared(folder: Path, config: dict[str, object]) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json", QUANT_FILE,
                 QUANT_ROWS_FILE, READY_MARKER):
        (folder / name).write_text(name)
    return folder


def test_hf_folder_adds_architectures_and_leaves_the_quant_blocks_out(tmp_path: Path) -> None:
    prepared = _prepared(tmp_path / "prepared", {"model_type": "llama", "hidden_size": 8})
    out = hf_folder(prepared, tmp_path / "hf")
    names = {p.name for p in out.iterdir()}
    assert names == {"config.json", "model.safetensors", "tokenizer.json",
                     "generation_config.json"}
    config = json.loads((out / "config.json").read_text())
    assert config == {"model_type": "llama", "hidden_size": 8,
                      "architectures": ["LlamaForCausalLM"]}
    assert (out / "model.safetensors").is_symlink()
    assert (out / "model.safetensors").resolve() == (prepared / "model.safetensors").resolve()
    assert not (prepared / "config.json").read_text().count("architectures")  # left as it was
    # Again, after the prepared folder lost a file: the same folder, without the stale link.
    (prepared / "tokenizer.json").unlink()
    hf_folder(prepared, out)
    assert {p.name for p in out.iterdir()} == names - {"tokenizer.json"}


def test_hf_folder_keeps_given_architectures(tmp_path: Path) -> None:
    prepared = _prepared(tmp_path / "p", {"model_type": "qwen2", "architectures": ["X"]})
    assert json.loads((hf_folder(prepared, tmp_path / "hf") / "config.json").read_text())[
        "architectures"] == ["X"]
    prepared = _prepared(tmp_path / "q", {"model_type": "qwen2"})
    assert json.loads((hf_folder(prepared, tmp_path / "hq") / "config.json").read_text())[
        "architectures"] == ["Qwen2ForCausalLM"]


def test_install_runs_once_per_key(tmp_path: Path) -> None:
    calls: list[str] = []
    key = stamp_key(package="p==1")
    assert not is_installed(tmp_path / "peer", key)
    assert install_once(tmp_path / "peer", key, lambda: calls.append("1"), "peer")
    assert is_installed(tmp_path / "peer", key)
    assert not install_once(tmp_path / "peer", key, lambda: calls.append("2"), "peer")
    assert calls == ["1"]
    other = stamp_key(package="p==2")  # another version: installed again
    assert install_once(tmp_path / "peer", other, lambda: calls.append("3"), "peer")
    assert calls == ["1", "3"] and not is_installed(tmp_path / "peer", key)


def test_an_interrupted_install_is_not_stamped(tmp_path: Path) -> None:
    key = stamp_key(package="p==1")

    def fails() -> None:
        raise RuntimeError("network")

    install_once(tmp_path / "peer", key, lambda: None, "peer")
    with pytest.raises(RuntimeError):
        install_once(tmp_path / "peer", stamp_key(package="p==2"), fails, "peer")
    assert not is_installed(tmp_path / "peer", key)
    assert not is_installed(tmp_path / "peer", stamp_key(package="p==2"))


def test_llamacpp_is_rebuilt_for_another_cpu() -> None:
    assert llamacpp_key(frozenset({"avx2", "fma"})) == llamacpp_key(frozenset({"fma", "avx2"}))
    assert llamacpp_key(frozenset({"avx2"})) != llamacpp_key(frozenset({"avx512f"}))


def test_the_avx2_llamacpp_is_its_own_portable_build() -> None:
    native, avx2 = peers.llamacpp_cmake("llamacpp"), peers.llamacpp_cmake("llamacpp-avx2")
    assert "-DGGML_NATIVE=ON" in native and "-DGGML_NATIVE=OFF" not in native
    assert "-DGGML_NATIVE=OFF" in avx2 and "-DGGML_AVX2=ON" in avx2
    assert "-DGGML_AVX512=OFF" in avx2 and "-DGGML_AMX_TILE=OFF" in avx2
    flags = frozenset({"avx2", "fma"})
    assert llamacpp_key(flags, "llamacpp") != llamacpp_key(flags, "llamacpp-avx2")
    homes = {peers.llamacpp_home(Path("/p"), peer) for peer in ("llamacpp", "llamacpp-avx2")}
    assert len(homes) == 2
    server = llamacpp_server(Path("/b/llama-server"), Path("/m/x.gguf"), "M", 9000, (0, 1),
                             slots=4, peer="llamacpp-avx2")
    assert server.peer == "llamacpp-avx2" and server.label == "llama.cpp AVX2"


def test_the_native_llamacpp_keeps_its_weights_unpacked_on_a_cpu_with_amx() -> None:
    def command(peer: str, flags: set[str]) -> tuple[str, ...]:
        return llamacpp_server(Path("/b/llama-server"), Path("/m/x.gguf"), "M", 9000, (0,),
                               slots=1, peer=peer, flags=frozenset(flags)).command
    assert "--no-repack" in command("llamacpp", {"avx2", "amx_int8"})
    assert "--no-repack" not in command("llamacpp", {"avx2", "avx512f"})
    assert "--no-repack" not in command("llamacpp-avx2", {"avx2", "amx_int8"})


def test_kernel_isa_from_metrics() -> None:
    page = ("# HELP raging_worker_kernels_info The kernels' ISA path per worker\n"
            "# TYPE raging_worker_kernels_info gauge\n"
            'raging_worker_kernels_info{isa="avx2",worker="decode-0"} 1.0\n'
            'raging_worker_kernels_info{isa="avx512",worker="prefill-0"} 1.0\n'
            "# TYPE raging_requests_total counter\nraging_requests_total 3.0\n")
    assert kernel_isa(page) == [{"isa": "avx2", "worker": "decode-0"},
                                {"isa": "avx512", "worker": "prefill-0"}]
    info = ("# TYPE raging_worker_kernels info\n"
            'raging_worker_kernels_info{isa="amx"} 1.0\n')
    assert kernel_isa(info) == [{"isa": "amx"}]
    assert kernel_isa("# TYPE raging_requests_total counter\nraging_requests_total 3.0\n") == []


def test_cpu_info(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9654\n"
                       "flags\t\t: fpu avx2 fma avx512f amx_tile sse2\n")
    info = cpu_info(cpuinfo)
    assert info.model == "AMD EPYC 9654"
    assert info.flags == ("amx_tile", "avx2", "avx512f", "fma", "fpu", "sse2")
    assert info.simd() == ("amx_tile", "avx2", "avx512f", "fma")
    assert cpu_info(tmp_path / "none") == CpuInfo("unknown", ())


def test_every_run_gets_prompts_of_its_own() -> None:
    args = _parse("--launch", "--prefill 1 --decode 1", "--num-requests", "4",
                  "--concurrency", "1,8", "--warmup", "2", "--output-len", "16")
    plan, workload = peers_plan(args, TextPrompts())
    assert workload.name == "messages" and workload.output_len == 16
    assert [load.concurrency for load in plan.loads] == [1, 8]
    assert len(plan.warmup) == 2 and [len(plan.requests_of(i)) for i in (0, 1)] == [4, 4]
    prompts = [s.prompt for s in plan.warmup] + [s.prompt for i in (0, 1)
                                                 for s in plan.requests_of(i)]
    assert len(set(prompts)) == 10  # warm-up and each run: all different
    spec = plan.requests_of(1)[0]
    assert spec.chat and spec.output_len == 16 and isinstance(spec.prompt, str)
    assert len(spec.prompt.split()) == 155  # --input-len 170's words
    assert plan.requests == plan.requests_of(0)


def test_flags() -> None:
    args = _parse("--peer", "vllm", "--peer", "llamacpp", "--peer", "vllm")
    assert args.peer == ["vllm", "llamacpp", "vllm"] and args.concurrency == (1, 32)
    assert args.num_requests == 32 and args.output_len == 64 and args.workload == "messages"
    assert args.peers_dir == Path("~/.cache/raging/peers")
    with pytest.raises(SystemExit):
        _parse("--peer", "sglang")
    with pytest.raises(SystemExit):
        _parse("--concurrency", "0,4")
    with pytest.raises(ValueError, match="--peer or --launch"):
        peers.prepare(_parse(), [])


def test_a_gguf_of_ones_own_is_served_by_llamacpp_and_ours_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "Mine.Q4_K_M.gguf"
    with pytest.raises(ValueError, match="vllm serves the default model"):
        peers.prepare(_parse("--peer", "vllm", "--gguf", str(gguf)), [])
    prepared = tmp_path / "prepared" / "Mine.Q4_K_M"
    monkeypatch.setattr(peers, "resolve_model", lambda name, cache_dir: prepared)
    monkeypatch.setattr(peers, "model_dir", lambda flags: tmp_path / "default")
    with pytest.raises(ValueError, match=r"Mine\.Q4_K_M\.gguf; --launch 'p1d1' serves another"):
        peers.prepare(_parse("--gguf", str(gguf), "--launch", "p1d1=--prefill 1"), [])
    monkeypatch.setattr(peers, "install_llamacpp", lambda peers_dir, peer: Path("/b/server"))
    server = peers.peer_server("llamacpp", tmp_path, (0,), 4, gguf)
    words = server.command
    assert words[words.index("-m") + 1] == str(gguf) and server.serves == str(gguf)
    assert words[words.index("--alias") + 1] == "Mine.Q4_K_M"  # as ours serves it


def test_a_plan_of_per_load_requests_has_one_per_load() -> None:
    spec = RequestSpec(0, "fixed", "hi", None, 4)
    with pytest.raises(ValueError):
        Plan((), (spec,), (Load(concurrency=1), Load(concurrency=2)), Slo(1, 1),
             load_requests=((spec,),))


def _run(concurrency: int, tokens_per_s: float, ttft: float, prompt_tokens: int = 203
         ) -> Measured:
    """Four requests of 8 tokens over a run whose length gives `tokens_per_s`."""
    duration = 4 * 8 / tokens_per_s
    results = tuple(RequestResult(i, "message", 0.0, 170, 8, ttft_s=ttft, e2e_s=ttft + 0.7,
                                  chunk_times_s=tuple(ttft + 0.1 * k for k in range(8)),
                                  prompt_tokens=prompt_tokens, output_tokens=8)
                    for i in range(4))
    run = LoadRun(results, duration, 0)
    return Measured(Load(concurrency=concurrency), run, summarize(run, Slo(2, 0.25)))


def _results() -> PeersResults:
    vllm = TargetResults("vllm-cpu", "http://a", "M", (_run(1, 20, 0.2), _run(32, 100, 1.0)))
    llama = TargetResults("llama.cpp", "http://b", "M", (_run(1, 40, 0.1), _run(32, 80, 0.8)))
    ours = TargetResults("p1d1", "http://c", "M", (_run(1, 30, 0.15), _run(32, 200, 0.5)),
                         launch_flags=("--prefill", "1", "--decode", "1"))
    serve = ServeResults(("python -m bench", "peers"), Workload("messages", 170, 8), "text", 4,
                         1, Slo(2, 0.25), False, (vllm, llama, ours))
    info = {"vllm-cpu": PeerInfo("vllm", "0.32.0", ("vllm", "serve"), {"X": "1"}, "/m"),
            "llama.cpp": PeerInfo("llamacpp", "0.3.36", ("llama-server",), {}, "/g.gguf")}
    cpu = CpuInfo("AMD EPYC", ("avx2", "fma", "sse2"))
    return PeersResults(serve, cpu, "0-1", info,
                        {"p1d1": [{"isa": "avx2", "worker": "decode-0"}]},
                        {"sglang": "sglang exited (1); its log ends:\nTraceback\nOSError: boom\n"})


def test_ratios_against_each_peer() -> None:
    results = _results()
    assert results.concurrencies() == (1, 32)
    assert results.references() == ("vllm-cpu", "llama.cpp")
    assert results.ratio("p1d1", "vllm-cpu", 32) == pytest.approx(2.0)
    assert results.ratio("p1d1", "llama.cpp", 1) == pytest.approx(0.75)
    assert results.ratio("p1d1", "llama.cpp", 8) is None  # nobody ran at 8
    rows = {row["label"]: row for row in peers_summary(results)}
    assert rows["p1d1"]["runs"][32]["vs"] == {"vllm-cpu": pytest.approx(2.0),
                                              "llama.cpp": pytest.approx(2.5)}
    assert rows["vllm-cpu"]["runs"][1]["vs"] == {"llama.cpp": pytest.approx(0.5)}
    assert rows["p1d1"]["runs"][1]["ttft_p50_s"] == pytest.approx(0.15)
    assert rows["p1d1"]["runs"][1]["itl_p50_s"] == pytest.approx(0.1)
    assert rows["p1d1"]["runs"][1]["tpot_p50_s"] == pytest.approx(0.1)
    assert rows["p1d1"]["runs"][1]["prompt_tokens_p50"] == 203
    assert rows["p1d1"]["peer"] is False and rows["llama.cpp"]["peer"] is True


def test_table_json_and_plot(tmp_path: Path) -> None:
    results = _results()
    markdown = peers_markdown(results)
    assert "CPU: AMD EPYC, CPUs 0-1 for every target; flags: avx2 fma" in markdown
    assert ("| p1d1 | 30.0 | 200.0 | 150 / 500 | 100 / 100 | 100 / 100 | 203 / 203 | "
            "1.50x / 2.00x | 0.75x / 2.50x | avx2 |") in markdown
    assert "| vllm-cpu | 20.0 | 100.0 |" in markdown
    assert "- vllm-cpu: 0.32.0, serving /m: `vllm serve` with X=1" in markdown
    assert "- sglang FAILED: sglang exited (1); its log ends: ... OSError: boom" in markdown
    assert "p1d1 c=32" in markdown  # serve's table of every run follows
    write_json(peers_json(results), tmp_path / "peers.json")
    document = json.loads((tmp_path / "peers.json").read_text())
    assert document["benchmark"] == "peers"
    assert document["cpu"] == {"model": "AMD EPYC", "flags": ["avx2", "fma", "sse2"],
                               "cpus": "0-1"}
    assert document["kernel_isa"]["p1d1"] == [{"isa": "avx2", "worker": "decode-0"}]
    assert document["peers"]["llama.cpp"]["command"] == ["llama-server"]
    summary = {row["label"]: row for row in document["summary"]}
    assert math.isclose(summary["p1d1"]["runs"]["32"]["vs"]["vllm-cpu"], 2.0)
    assert len(document["targets"]) == 3 and document["failed"]["sglang"].endswith("boom\n")
    plot_peers(results, tmp_path / "peers.png")
    with Image.open(tmp_path / "peers.png") as image:
        assert image.format == "PNG" and image.size[0] > 1000


SERVER = """
import http.server, json, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
class Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "M"}]}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Models).serve_forever()
"""


def test_serving_waits_for_the_model_list_and_stops_the_whole_group(tmp_path: Path) -> None:
    port = peers.free_port()
    server = PeerServer("fake", "fake", "0", (sys.executable, "-c", SERVER, str(port)),
                        port=port)
    with serving(server, tmp_path / "fake.log", timeout_s=60) as process:
        deadline = time.monotonic() + 30
        while len(tree := process_tree(process.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(tree) == 2  # the server and the child it started
        pids = list(tree.values())
    time.sleep(0.2)
    assert not [pid for pid in pids if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def test_a_peer_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    server = PeerServer("fake", "fake", "0",
                        (sys.executable, "-c", "print('no such model'); raise SystemExit(3)"),
                        port=peers.free_port())
    with pytest.raises(RuntimeError, match=r"exited \(3\)[^$]*no such model"), \
            serving(server, tmp_path / "fake.log", timeout_s=60):
        pass
