"""Configuration: frozen dataclasses loaded from `configs/*.yaml`, with dotted overrides.

Every process loads the same file; the CLI turns its flags into overrides such as
`{"gateway.port": 8080}` (core/cli.py derives each flag from the field it sets: type, choices,
help), so that no setting is read from the environment deep in the code. Each section refuses
keys it does not have, so a prefill-only key in the decode section is an error, not ignored.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import yaml

from core.codec import is_int, literal_values
from core.netaddr import is_local_endpoint

T = TypeVar("T")
ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]
KVBackend = Literal["zmq", "shm", "cuda_ipc"]
KV_BACKENDS: tuple[KVBackend, ...] = typing.get_args(KVBackend)
# "auto": cuda_ipc from a worker whose model is on a GPU, else shm (kvtransfer.make_sender).
KVBackendSetting = Literal["auto", "zmq", "shm", "cuda_ipc"]
LogFormat = Literal["text", "json"]
Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = typing.get_args(Role)
ToolCallParser = Literal["", "hermes", "llama3_json"]
ReasoningParser = Literal["", "deepseek_r1", "qwen3"]
KernelIsa = Literal["auto", "generic", "avx2", "avx512", "avx512_bf16", "amx"]
# How the gateway spreads new work over workers pinned to the same CPUs (gateway/packing.py).
Routing = Literal["pack", "spread"]
# Where a prompt goes whose prefix a decode worker holds (gateway/routing.py).
HistoryRouting = Literal["follow", "spread"]
PullMode = Literal["auto", "always", "never"]
# What the products over the quant blocks multiply the weights with (engine/weights/quant_blocks).
QuantInputs = Literal["exact", "int8"]
WeightsMode = Literal["auto", "dense", "quant"]


def is_device_name(name: str) -> bool:
    """Whether `name` is a `model.device`: auto, cpu, cuda or cuda:N."""
    kind, _, index = name.partition(":")
    if kind == "cuda" and index:
        return index.isdigit()
    return name in ("auto", "cpu", "cuda")


def sim_profile_of(model_name: str) -> str | None:
    """The profile `--model sim` (default) or `--model sim:PROFILE` names; None for a real
    model."""
    if model_name == "sim":
        return "default"
    kind, colon, profile = model_name.partition(":")
    return profile if kind == "sim" and colon else None


def setting(default: T, help: str) -> T:
    """A config field and what it means (the help of the flag that sets it, where one does)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ModelConfig:
    name: str = setting("SmolLM2-135M-Instruct",
                        "packaged model name or local Hugging Face folder; sim or "
                        "sim:PROFILE: a simulated model (configs/sim, docs/simulation.md)")
    cache_dir: str = setting("~/.cache/raging/models", "where packaged models are prepared")
    dtype: ModelDtype = setting("auto", "auto: bfloat16 on a GPU and where the CPU multiplies "
                                        "bf16 in hardware (AMX, AVX512-BF16), else float32")
    device: str = setting("auto", "where weights, KV cache and sampling live: cpu, cuda, "
                                  "cuda:N, or auto (cuda where torch sees a GPU, else cpu)")
    max_model_len: int = setting(0, "0: the model's own max_position_embeddings")
    quant_rows: int = setting(-1, "products of at most this many rows (decode steps of few "
                                  "sequences) read the GGUF's 4-/8-bit quant blocks, where the "
                                  "weights are exactly those; -1: as many as is faster, "
                                  "measured once per machine; 0: never")
    weights: WeightsMode = setting("auto", "which copies of the weight matrices workers multiply: "
                                           "quant: the GGUF's quant blocks alone (memory-mapped, "
                                           "shared by every worker on a host); dense: a dense "
                                           "copy too, for long chunks; auto: as the folder has "
                                           "them, and a dense copy of a GGUF's blocks if it "
                                           "takes under a quarter of the free memory")
    tp: int = setting(1, "tensor parallel: each worker's model split over this many processes "
                         "(CPUs, gloo; heads and MLP columns per process, one shared KV cache)")
    quant_inputs: QuantInputs = setting("exact", "exact: those products multiply the inputs as "
                                                 "they are (results equal the dense product's "
                                                 "up to summation order); int8: inputs quantized "
                                                 "to 8-bit blocks and multiplied in integers, as "
                                                 "llama.cpp does (faster, less exact)")

    @property
    def sim_profile(self) -> str | None:
        """The profile a simulated model (`sim`, `sim:PROFILE`) runs by; None for a real one."""
        return sim_profile_of(self.name)

    def __post_init__(self) -> None:
        if self.name.startswith("sim:") and not self.name[4:]:
            raise ValueError("model.name sim: needs a profile after the colon (sim:default)")
        if not is_device_name(self.device):
            raise ValueError(f"model.device must be auto, cpu, cuda or cuda:N, "
                             f"not {self.device!r}")
        if self.tp < 1:
            raise ValueError(f"model.tp must be 1 or more, not {self.tp}")
        if self.quant_rows < -1:
            raise ValueError(f"model.quant_rows must be -1 (measured), 0 (never) or more, "
                             f"not {self.quant_rows}")


_LONGEST_WAIT_S = 86400.0  # a day: longer is forever, which a timed wait cannot take


@dataclass(frozen=True)
class EngineConfig:
    """How a worker's kernels run: on its CPU (engine.kernels.isa), or on a GPU."""

    isa: KernelIsa = setting("auto", "the instruction set the C++ kernels are built for and run "
                                     "at: auto (the highest this CPU runs), or one level to "
                                     "force it (refused where the CPU lacks it)")
    cuda_graphs: bool = setting(True, "on a GPU, replay decode steps as captured CUDA graphs "
                                      "(small batches are bound by kernel launches otherwise)")
    grammar_tables_at_start: bool = setting(
        True, "build the grammar tables (xgrammar and the tokenizer imported: ~1.5 s of a CPU) on "
              "the worker's grammar thread once it has registered, so that the first request "
              "with a grammar does not wait for them; false: when the first one comes (a worker "
              "that never sees one never spends it)")
    cpu_turns_dir: str = setting("", "a folder of lock files through which workers on the same "
                                     "CPUs compute in turn (core/turns.py; launch.sh gives its "
                                     "run folder's); empty: each computes when it likes")
    cpu_turn_patience_s: float = setting(3.0, "a worker waits this long at most for its turn; "
                                              "past it, it computes beside the holder (stopped "
                                              "or wedged) until that one lets go; keep it below "
                                              "gateway.stall_timeout_s")

    def __post_init__(self) -> None:
        if not 0 < self.cpu_turn_patience_s <= _LONGEST_WAIT_S:
            raise ValueError(f"engine.cpu_turn_patience_s must be in (0, {_LONGEST_WAIT_S:g}] "
                             f"s, not {self.cpu_turn_patience_s}")


@dataclass(frozen=True)
class SimConfig:
    """The simulated engine of `--model sim` (engine/sim): real workers, channels and KV bytes,
    the forward pass replaced by its profile's step times."""

    kv_bytes: float = setting(1.0, "the share of the profile's KV bytes per token its cache "
                                   "holds and its transfers move (a thousand streams of an 8B "
                                   "model's KV do not fit this host's memory)")
    time_scale: float = setting(1.0, "step times are the profile's times this (0: no sleep, "
                                     "for the gateway's own limits)")

    def __post_init__(self) -> None:
        if not 0 < self.kv_bytes <= 1 or self.time_scale < 0:
            raise ValueError("sim.kv_bytes must be in (0, 1] and sim.time_scale >= 0")


@dataclass(frozen=True)
class GatewayConfig:
    host: str = setting("127.0.0.1", "HTTP address to bind")
    port: int = setting(8000, "HTTP port")
    control_address: str = setting("tcp://127.0.0.1:8100",
                                   "the gateway's control socket, which workers connect to")
    expect_prefill: int = setting(1, "prefill workers /health waits for")
    expect_decode: int = setting(1, "decode workers /health waits for")
    max_inflight_requests: int = setting(512, "requests admitted at once; beyond it, 429")
    max_queued_tokens: int = setting(65536, "prompt tokens waiting for prefill; beyond it, 429")
    heartbeat_timeout_s: float = setting(2.5, "a worker silent this long is dead (heartbeats: "
                                              "0.5 s): its requests resume elsewhere")
    stall_timeout_s: float = setting(10.0, "a worker with work but no layer computed this long "
                                           "is stalled: not routed to")
    progress_timeout_s: float = setting(300.0, "a request with no new token this long fails")
    worker_wait_s: float = setting(30.0, "when the last decode worker dies (and is restarted), "
                                         "requests wait for one to join until this long after "
                                         "(then they fail; new ones: 503 at once); 0: they fail "
                                         "at once")
    keepalive_s: float = setting(10.0, "an SSE comment this often while a stream waits")
    # Longer than clients keep theirs (httpx and the openai client: 5 s), so that no client
    # sends on a connection being closed.
    http_keep_alive_s: int = setting(75, "an idle client connection stays open this long")
    max_body_bytes: int = setting(16 * 1024 * 1024, "larger request bodies get 413")
    local_prefill_max_tokens: int = setting(32, "conditional disaggregation: prompts this short "
                                                "are prefilled on the decode worker (0: none, "
                                                "unless no prefill pool)")
    prefill_saturated_tokens: int = setting(1024, "... and, while every prefill worker holds "
                                                  "this many tokens (0: never), ...")
    saturated_local_max_tokens: int = setting(256, "... prompts up to this long")
    decode_routing: Routing = setting("pack", "pack: decode workers pinned to the same CPUs "
                                              "take new sequences one at a time, each filling "
                                              "its batch before the next gets any; spread: the "
                                              "most free KV, whatever the CPUs")
    prefill_routing: Routing = setting("pack", "pack: prefill workers pinned to the same CPUs "
                                               "count as one, their queues added, and prompts "
                                               "go to the busiest with room; spread: each "
                                               "worker by its own queue")
    pack_kv_fraction: float = setting(0.9, "pack: a worker takes no more while its KV would "
                                           "be fuller than this (its sequences still grow)")
    history_routing: HistoryRouting = setting("follow", "follow: a prompt whose prefix (a "
                                                        "chat's history) a decode worker "
                                                        "holds goes there, to prefill the "
                                                        "rest; spread: to another decode "
                                                        "worker with room, if any")
    pull_prefixes: PullMode = setting("auto", "a decode worker prefilling a prompt first "
                                              "pulls the KV of its prefix from the worker "
                                              "caching the most of it: auto, when that is "
                                              "quicker than computing it; always; never")
    pull_min_tokens: int = setting(64, "a cached prefix longer by fewer tokens than the decode "
                                       "worker holds itself is computed, not pulled")
    pull_bandwidth_mb_s: float = setting(500.0, "KV transfer rate assumed of a worker until "
                                                "its sends are measured")
    tool_call_parser: ToolCallParser = setting("", "how tool_choice 'auto' finds calls in the "
                                                   "output: hermes (<tool_call> JSON), "
                                                   "llama3_json; empty: none, output is text")
    reasoning_parser: ReasoningParser = setting("", "how a chat reply's thinking is told from "
                                                    "its answer: qwen3 (an output opening with "
                                                    "<think>), deepseek_r1 (every output opens "
                                                    "in thought); empty: all is the answer")
    grammar_in_reasoning: bool = setting(False, "with a reasoning parser, a grammar "
                                                "(structured output, a forced tool call) "
                                                "constrains the thinking too; false: it "
                                                "applies from the end of the thought, as "
                                                "vLLM's structured_outputs.enable_in_reasoning")
    max_parallel_tool_calls: int = setting(4, "calls a forced tool_choice ('required') may "
                                              "make at most, so that a small model that "
                                              "repeats its call ends (0: no bound)")
    strict_fields: bool = setting(False, "refuse (400) request fields outside the schema; "
                                         "off: they are ignored, logged once and counted")
    served_model_name: tuple[str, ...] = setting((), "names the model answers to (each "
                                                     "accepted in `model`); empty: its own")
    allowed_origins: tuple[str, ...] = setting(("*",), "web pages (origins) whose scripts "
                                                       "may call the API from a browser "
                                                       "(CORS); *: any, as vLLM and "
                                                       "llama.cpp allow; empty: none")
    stored_responses: int = setting(256, "/v1/responses kept in memory per tenant, for "
                                         "previous_response_id and GET (the least recently "
                                         "used go first); 0: none kept")

    def __post_init__(self) -> None:
        if not 0 < self.pack_kv_fraction <= 1:
            raise ValueError(f"gateway.pack_kv_fraction must be in (0, 1], "
                             f"not {self.pack_kv_fraction}")
        if self.worker_wait_s < 0:
            raise ValueError(f"gateway.worker_wait_s must be >= 0, not {self.worker_wait_s}")
        if self.stored_responses < 0:
            raise ValueError(f"gateway.stored_responses must be >= 0, "
                             f"not {self.stored_responses}")


@dataclass(frozen=True)
class PoolConfig:
    """What the workers of either pool set: their KV pool, threads, CPUs and heartbeats."""

    num_kv_blocks: int = setting(4096, "KV cache blocks of each worker")
    block_size: int = setting(16, "tokens per KV block")
    # Prompts are prefilled earliest deadline first: arrival + this much per prompt token.
    ttft_ms_per_token: float = setting(5.0, "a prompt's deadline: arrival + this per token")
    threads: int = setting(0, "torch intra-op threads; 0: one per CPU the worker may run on "
                              "(those it is pinned to)")
    cpus: str = setting("", "pin each worker to these CPUs (1, 0-1, 0,2); empty: no pinning")
    tp: int = setting(0, "processes each worker of this pool splits its model over; 0: "
                         "model.tp (KV moves between workers of any two)")
    prefix_caching: bool = setting(True, "keep full KV blocks for later prompts to reuse")
    prefix_cache_share: float = setting(1.0, "the share of the KV pool the prefix cache may "
                                             "keep; idle cached blocks beyond it go, least "
                                             "recently used first")
    heartbeat_interval_s: float = setting(0.5, "how often a worker reports its load")
    gpu_memory_fraction: float = setting(0.0, "on a GPU, the share of its memory each worker "
                                              "may take (workers sharing one GPU); 0: no cap")
    drain_timeout_s: float = setting(30.0, "a draining worker (SIGTERM, POST /admin/drain) "
                                           "leaves after this long even with work left, "
                                           "which resumes on other workers")
    health_port: int = setting(0, "a health endpoint on 127.0.0.1 for probes inside its "
                                  "container (python -m core.health); 0: none")

    def __post_init__(self) -> None:
        if self.ttft_ms_per_token < 0:
            raise ValueError("ttft_ms_per_token must be >= 0")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if not 0 <= self.gpu_memory_fraction <= 1:
            raise ValueError("gpu_memory_fraction must be in [0, 1]")
        if not 0 < self.prefix_cache_share <= 1:
            raise ValueError("prefix_cache_share must be in (0, 1]")
        if self.tp < 0:
            raise ValueError("tp must be >= 0 (0: model.tp)")


@dataclass(frozen=True)
class PrefillConfig(PoolConfig):
    """Prefill workers. Step budgets are in tokens at an empty context: deeper tokens cost more
    (engine/model/chunk_cost.py)."""

    max_batch_tokens: int = setting(2048, "a step's budget: a prompt that arrives waits one "
                                          "step at most")
    chunk_tokens: int = setting(256, "a prompt longer than a step is prefilled in chunks of "
                                     "at most this much, others between")


@dataclass(frozen=True)
class DecodeConfig(PoolConfig):
    """Decode workers."""

    max_running: int = setting(64, "sequences in one batch at most")
    chunk_tokens: int = setting(512, "prompt tokens per step when it prefills itself, beside "
                                     "the running sequences' next tokens")
    kv_bind: str = setting("tcp://127.0.0.1:*", "where it receives KV: an address the prefill "
                                                "workers can reach (an interface's own IP, not "
                                                "0.0.0.0, since it is advertised as it is)")
    speculative_tokens: int = setting(6, "n-gram speculation: guess up to this many next "
                                         "tokens of a sequence from its earlier text and check "
                                         "them in one step (decode/drafts.py); 0: off")
    speculative_max_running: int = setting(64, "speculate only while at most this many "
                                               "sequences run; within it, each sequence "
                                               "guesses only the tokens that pay for their "
                                               "rows (decode/guessing.py)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.speculative_tokens < 0 or self.speculative_max_running < 0:
            raise ValueError("decode.speculative_tokens and speculative_max_running must be "
                             ">= 0")
        host = urlsplit(self.kv_bind).hostname if "://" in self.kv_bind else None
        if host in ("0.0.0.0", "::", "*"):
            raise ValueError(f"decode.kv_bind {self.kv_bind!r} cannot be advertised to prefill "
                             f"workers: bind one address they reach (tcp://10.0.0.5:*)")


@dataclass(frozen=True)
class KVTransferConfig:
    """How prefill workers send KV; decode workers accept every backend."""

    backend: KVBackendSetting = setting("auto", "zmq (tcp/ipc, any host), shm (one host), "
                                               "cuda_ipc (GPUs of one host), or auto: cuda_ipc "
                                               "from a worker on a GPU, else shm")
    buffer_mb: int = setting(64, "the shm / cuda_ipc staging buffer of each prefill worker")
    lease_s: float = setting(30.0, "a staged chunk not released by then is reclaimed")
    chunk_mb: float = setting(8.0, "layers of a request go together until a chunk holds this")
    pull_lease_s: float = setting(5.0, "a decode worker pulling a cached prefix from another "
                                       "worker computes it itself if none of it came by then")

    def __post_init__(self) -> None:
        if min(self.buffer_mb, self.lease_s, self.chunk_mb, self.pull_lease_s) <= 0:
            raise ValueError("kv_transfer.buffer_mb, lease_s, chunk_mb and pull_lease_s must "
                             "be positive")


@dataclass(frozen=True)
class AutoscaleConfig:
    """The gateway's count of the workers each pool wants, `raging_pool_desired_workers{role}`
    (gateway/autoscale.py): what an autoscaler (Kubernetes' HPA, launch.sh --autoscale) sizes
    the pools by."""

    ttft_slo_ms: float = setting(2000.0, "time to first token the prefill pool is sized to keep "
                                         "(recent mean): over it, one worker more")
    tpot_slo_ms: float = setting(250.0, "time per output token the decode pool is sized to "
                                        "keep (recent mean): over it, one worker more")
    prefill_queue_tokens: int = setting(4096, "prompt tokens waiting that one prefill worker "
                                              "should have at most")
    decode_kv_fraction: float = setting(0.8, "share of its KV blocks a decode worker should use "
                                             "at most")
    decode_batch_fraction: float = setting(0.8, "share of its batch (decode.max_running) a "
                                                 "decode worker should fill at most")
    scale_down_s: float = setting(60.0, "a pool shrinks, one worker at a time, only after "
                                        "wanting fewer this long")
    poll_s: float = setting(2.0, "how often launch.sh --autoscale reads the counts the pools "
                                 "want")

    def __post_init__(self) -> None:
        if not (self.ttft_slo_ms > 0 and self.tpot_slo_ms > 0 and self.prefill_queue_tokens > 0
                and 0 < self.decode_kv_fraction <= 1 and 0 < self.decode_batch_fraction <= 1
                and self.scale_down_s >= 0 and 0 < self.poll_s <= 3600):
            raise ValueError("autoscale: SLOs and prefill_queue_tokens > 0, fractions in (0, 1], "
                             "scale_down_s >= 0, poll_s in (0, 3600]")


@dataclass(frozen=True)
class AuthConfig:
    """The gateway's API keys, each naming its tenant; none at all leaves the gateway open.

    Checked by the gateway (gateway/auth.py), which also reads `keys_file`; workers ignore it.
    """

    api_keys: tuple[str, ...] = field(default=(), repr=False,
                                      metadata={"help": "KEY or KEY:TENANT each"})
    keys_file: str = setting("", "keys file, one 'KEY TENANT' per line (kept out of argv, "
                                 "which ps shows, and of the YAML)")


@dataclass(frozen=True)
class InternalConfig:
    """Authentication of the internal ZeroMQ channels (control and KV) with CURVE: every
    process of a cluster reads the same keys folder (`python -m core.curve generate DIR`)."""

    curve: bool = setting(False, "off: plain ZeroMQ, anyone who reaches a port may talk to it")
    keys_dir: str = setting("", "server.key_secret, client.key_secret, allowed_clients/*.key")
    host: str = setting("", "the host this process reports: workers of one host hand KV over "
                            "through shared memory, others over TCP; empty: the host name")

    def __post_init__(self) -> None:
        if self.curve and not self.keys_dir:
            raise ValueError("internal.curve needs internal.keys_dir")


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry traces of requests across the processes (docs/observability.md)."""

    otlp_endpoint: str = setting("", "export spans over OTLP/HTTP to this collector URL "
                                     "(http://HOST:4318; /v1/traces is added when the URL has "
                                     "no path); empty: tracing off, opentelemetry not imported")

    def __post_init__(self) -> None:
        url = urlsplit(self.otlp_endpoint)
        if self.otlp_endpoint and (url.scheme not in ("http", "https") or not url.netloc):
            raise ValueError(f"tracing.otlp_endpoint must be an http(s) URL, "
                             f"not {self.otlp_endpoint!r}")


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request that does not say gets. With `from_model`, the model folder's
    generation_config.json overrides the sampling values it has (as vLLM's
    `--generation-config auto`); a request's own values always win."""

    from_model: bool = setting(True, "take sampling defaults from the model's "
                                     "generation_config.json where it has them")
    temperature: float = setting(0.2, "sampling temperature (0: greedy)")
    top_p: float = setting(0.9, "nucleus sampling mass (1: off)")
    top_k: int = setting(0, "keep the k most likely tokens (0: off)")
    min_p: float = setting(0.0, "drop tokens below this times the top token's probability")
    repetition_penalty: float = setting(1.1, "over prompt and output (1: off)")
    max_tokens: int = setting(2048, "the completion's length cap for a request that sets "
                                    "none (/v1/completions: OpenAI's 16, unless this is less)")

    def __post_init__(self) -> None:
        if not (0 <= self.temperature <= 2 and 0 < self.top_p <= 1 and self.top_k >= 0
                and 0 <= self.min_p <= 1 and self.repetition_penalty > 0
                and self.max_tokens >= 1):
            raise ValueError("generation_defaults: temperature in [0, 2], top_p in (0, 1], "
                             "top_k >= 0, min_p in [0, 1], repetition_penalty > 0, "
                             "max_tokens >= 1")


@dataclass(frozen=True)
class LoggingConfig:
    """How every process (gateway, prefill, decode) logs, to stderr."""

    format: LogFormat = setting("text", "text: lines for people; json: one JSON object a line "
                                        "(time, level, logger, process, message, and "
                                        "request_id, epoch where it concerns a request)")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    internal: InternalConfig = field(default_factory=InternalConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        for name, address in (("gateway.control_address", self.gateway.control_address),
                              ("decode.kv_bind", self.decode.kv_bind)):
            if not self.internal.curve and not is_local_endpoint(address):
                raise ValueError(f"{name} {address!r} is reachable from other hosts: it needs "
                                 f"internal.curve (launch.sh turns it on)")

    def pool(self, role: Role) -> PrefillConfig | DecodeConfig:
        """The section of the workers of `role`."""
        return self.prefill if role == "prefill" else self.decode


def load_config(path: str | Path | None = None,
                overrides: dict[str, object] | None = None) -> Config:
    """Read a YAML file (or defaults), apply `section.key` overrides (text is parsed as YAML
    unless the setting is text; typed values are taken as they are), and validate types."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _parse_yaml(Path(path).read_text(), str(path)) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: top level must be a mapping")
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if not key:
            raise ValueError(f"override {dotted!r} must look like section.key")
        # A str setting takes the text as is: "123", "yes" or "~" must not turn into 123/True/None.
        parsed = value
        if isinstance(value, str) and not _is_text(_hint_of(section, key)):
            parsed = _parse_yaml(value, f"override {dotted!r}")
        section_raw = raw.setdefault(section, {})
        if not isinstance(section_raw, dict):
            raise ValueError(f"config.{section}: expected a mapping")
        section_raw[key] = parsed
    return from_mapping(Config, raw, "config")


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not valid YAML: {exc}") from None


def config_field(dotted: str) -> tuple[dataclasses.Field[Any], Any]:
    """The field `section.key` names and its type; ValueError for an unknown key."""
    section, _, key = dotted.partition(".")
    section_hint = typing.get_type_hints(Config).get(section)
    if not (isinstance(section_hint, type) and dataclasses.is_dataclass(section_hint)):
        raise ValueError(f"no config key {dotted!r}")
    fields = {f.name: f for f in dataclasses.fields(section_hint)}
    if key not in fields:
        raise ValueError(f"no config key {dotted!r}")
    return fields[key], typing.get_type_hints(section_hint)[key]


def _hint_of(section: str, key: str) -> Any:
    try:
        return config_field(f"{section}.{key}")[1]
    except ValueError:  # an unknown key: from_mapping names it
        return None


def _is_text(hint: Any) -> bool:
    values = literal_values(hint)
    return hint is str or (values is not None and all(isinstance(v, str) for v in values))


def from_mapping(cls: type[T], raw: dict[str, Any], where: str) -> T:
    """A config dataclass from a parsed YAML mapping, each value checked against its type."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping")
    assert dataclasses.is_dataclass(cls), f"{cls} is not a dataclass"
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    values = {name: _convert(hints[name], raw[name], f"{where}.{name}") for name in raw}
    built: T = cls(**values)
    return built


def _convert(hint: Any, value: Any, where: str) -> Any:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_mapping(hint, {} if value is None else value, where)
    if typing.get_origin(hint) is tuple:
        return _convert_tuple(hint, value, where)
    if typing.get_origin(hint) is dict:
        return _convert_dict(hint, value, where)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    values = literal_values(hint)
    if values is not None:
        if value in values:
            return value
        raise ValueError(f"{where}: expected one of {list(values)}, got {value!r}")
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if any(_is_instance(value, t) for t in allowed):
        return value
    raise ValueError(f"{where}: expected {hint}, got {value!r}")


def _convert_tuple(hint: Any, value: Any, where: str) -> tuple[Any, ...]:
    """`tuple[X, ...]` of scalars from a YAML list. The items are not echoed in errors: they
    may be secrets (API keys)."""
    item_hint = typing.get_args(hint)[0]
    items = () if value is None else value
    if not isinstance(items, list | tuple) or not all(_is_instance(v, item_hint) for v in items):
        raise ValueError(f"{where}: expected a list of {item_hint.__name__}")
    return tuple(items)


def _convert_dict(hint: Any, value: Any, where: str) -> dict[str, Any]:
    """`dict[str, X]` of scalars from a YAML mapping."""
    key_hint, item_hint = typing.get_args(hint)
    if not isinstance(value, dict) or not all(isinstance(k, key_hint) for k in value):
        raise ValueError(f"{where}: expected a mapping of {key_hint.__name__} keys")
    return {key: _convert(item_hint, item, f"{where}.{key}") for key, item in value.items()}


def _is_instance(value: Any, hint: Any) -> bool:
    if hint is type(None):
        return value is None
    if hint is int:
        return is_int(value)
    return isinstance(value, hint)
