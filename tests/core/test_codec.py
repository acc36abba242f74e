"""The control-plane codec: every message round-trips; anything else raises MalformedMessage."""

from __future__ import annotations

import dataclasses
import pickle
import random
from pathlib import Path
from typing import Any

import msgpack
import pytest

from core.codec import Codec, MalformedMessage
from core.messages import (
    Abort,
    Alive,
    DecodeRequest,
    Drain,
    Drained,
    FirstToken,
    GenerationTask,
    Grammar,
    Heartbeat,
    Leave,
    Message,
    PrefillRequest,
    PromptLogprob,
    PromptLogprobs,
    PullTotals,
    Register,
    RegisterAgain,
    RegisterReply,
    RequestFailed,
    Sampling,
    SharedPrefix,
    SharePrefix,
    StageTime,
    Thinking,
    TokenBatch,
    TokenBias,
    TokenEvent,
    TopLogprob,
    decode,
    encode,
)
from kvtransfer.wire import FORWARD_CODEC, KVHeader, KVNotice, Placement

MESSAGE_TYPES = (
    Register, RegisterReply, RegisterAgain, Leave, Heartbeat, PrefillRequest, DecodeRequest,
    FirstToken, TokenBatch, Abort, RequestFailed, Alive, Drain, Drained, SharePrefix, SharedPrefix,
    PromptLogprobs,
)
TAG = {cls: tag for tag, cls in enumerate(MESSAGE_TYPES)}
TASK = GenerationTask(
    prompt_ids=[1, 2, 3], sampling=Sampling(0.7, 0.9, 40, 1234), max_tokens=16,
    stop_token_ids=[2], ignore_eos=False,
)
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
SAMPLES: list[Message] = [
    Register("p1", "inst", "prefill", "", "fp", 16, 640),
    Register("d1", "inst", "decode", "tcp://127.0.0.1:5555", "fp", 16, 1024),
    RegisterReply(True, ""),
    RegisterReply(False, "KV layout mismatch"),
    RegisterAgain("unknown worker"),
    Leave("d1", "inst"),
    Alive("d1", "inst"),
    Heartbeat("d1", "inst", 10, 500, 3, 1),
    Heartbeat("d1", "inst", 0, 500, 0, 0, draining=True),
    Heartbeat("d1", "inst", 0, 500, 0, 0, pulls=PullTotals(3, 1, 1200, 55_296_000, 0.05, 1.1),
              prefill_s_per_token=0.0009),
    Register("d2", "inst", "decode", "tcp://127.0.0.1:5556", "fp", 16, 1024, "node-2", [1], 1,
             64, "amx", True, 46_080, 512),
    Drain("POST /admin/drain"),
    Drained(),
    PrefillRequest("r1", 0, TASK, "d1", "ipc:///tmp/kv"),
    PrefillRequest("r2", 3, GenerationTask([], Sampling(), 1, [], True), "d2", ""),
    PrefillRequest("r5", 0, TASK, "d1", "ipc:///tmp/kv", ["r6", "r7"]),
    PrefillRequest("r8", 0, TASK, "d1", "tcp://10.0.0.3:5557", [], "", "node-3"),
    PrefillRequest("r9", 0, TASK, "d1", "ipc:///tmp/kv", pull_from="d2", pull_tokens=48),
    SharePrefix("r9", 0, [1, 2, 3], "salt", 48, "d2", "d1", "ipc:///tmp/kv", "node-1"),
    SharedPrefix("r9", 0, 48, "fp"),
    SharedPrefix("r9", 0, 0, ""),
    DecodeRequest("r1", 1, TASK, "model|float32"),
    DecodeRequest("r5", 0, TASK, "model|float32", ["r6", "r7"]),
    DecodeRequest("r6", 0, GenerationTask([1, 2], Sampling(), 1, [], True, prompt_logprobs=5),
                  "fp"),
    PromptLogprobs("r6", 0, [PromptLogprob(-1.25, [TopLogprob(7, -0.5), TopLogprob(2, -1.25)]),
                             PromptLogprob(-0.0, [])]),
    FirstToken("r1", 0, 42, None),
    FirstToken("r1", 0, 2, "stop"),
    FirstToken("r1", 0, 42, None, 3, -0.25, [TopLogprob(42, -0.25), TopLogprob(7, -2.0)]),
    TokenBatch([]),
    TokenBatch([TokenEvent("r1", 0, 1, 7, None), TokenEvent("r2", 1, 5, 8, "length")]),
    TokenBatch([TokenEvent("r1", 0, 1, 7, None, -1.5, [TopLogprob(7, -1.5)]),
                TokenEvent("r1", 0, 2, 8, None, 0.0, [])]),
    DecodeRequest("r3", 0, GenerationTask(
        [1, 2, 3, 4], Sampling(0.5, 0.9, 0, None, 0.5, -0.5, 1.2, 5,
                           logit_bias=[TokenBias(3, -100.0), TokenBias(4, 2.5)]),
        8, [2], False, "salt",
        min_tokens=3, output_start=2), "fp"),
    DecodeRequest("r4", 0, GenerationTask([1], Sampling(), 8, [], False,
                                           grammar=Grammar("regex", "[a-z]+"),
                                           thinking=Thinking(opened=True)), "fp"),
    Abort("r1", 2),
    RequestFailed("r1", 0, "out of blocks: ünïcödé ✓"),
    # Stage durations and trace context (docs/observability.md).
    PrefillRequest("r8", 1, TASK, "d1", "", [], TRACEPARENT),
    DecodeRequest("r8", 1, TASK, "fp", [], TRACEPARENT),
    FirstToken("r8", 1, 42, None, 0, None, [],
               [StageTime("prefill_wait", 0.0), StageTime("prefill_compute", 0.125)]),
    TokenBatch([TokenEvent("r8", 1, 1, 7, None, None, [],
                           [StageTime("kv_transfer", 0.002), StageTime("first_decode", 0.03)])]),
]


# presence, frequency, repetition penalty; logprobs; min_p, allowed_token_ids, bad_words,
# logit_bias
NEUTRAL_EXTRAS: list[Any] = [0.0, 0.0, 1.0, None, 0.0, None, [], []]


def raw_task(sampling: list[Any]) -> list[Any]:
    """A GenerationTask as msgpack data, with `sampling`'s first four fields (the rest
    neutral unless given)."""
    return [[1], [*sampling, *NEUTRAL_EXTRAS[len(sampling) - 4:]], 4, [], False, "", 0, None,
            None, None, 0, None, False]


def packed(*items: Any) -> bytes:
    """Raw msgpack, built by hand to look like (or almost like) an encoded message."""
    return msgpack.packb(list(items), use_bin_type=True)


def assert_malformed(data: bytes) -> None:
    with pytest.raises(MalformedMessage):
        decode(data)


def test_samples_cover_every_message_type() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES)
    assert set(Message.__args__) == set(MESSAGE_TYPES)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: Message) -> None:
    data = encode(message)
    assert isinstance(data, bytes)
    back = decode(data)
    assert back == message and type(back) is type(message)


def test_tag_is_the_index_in_the_message_union() -> None:
    for message in SAMPLES:
        assert msgpack.unpackb(encode(message))[0] == TAG[type(message)]


def test_nested_values_come_back_typed() -> None:
    back = decode(encode(PrefillRequest("r1", 0, TASK, "d1", "a")))
    assert isinstance(back, PrefillRequest)
    assert isinstance(back.task, GenerationTask) and isinstance(back.task.sampling, Sampling)
    events = [TokenEvent("r", 0, index, 10 + index, None) for index in range(1, 4)]
    batch = decode(encode(TokenBatch(events)))
    assert isinstance(batch, TokenBatch)
    assert all(isinstance(e, TokenEvent) for e in batch.events) and batch.events == events
    assert [(e.index, e.token_id) for e in batch.events] == [(1, 11), (2, 12), (3, 13)]


def test_optional_fields_take_none_or_a_value() -> None:
    for seed in (None, 0, 2**63 - 1, -5):
        sampling = Sampling(seed=seed)
        task = GenerationTask([1], sampling, 4, [], False)
        back = decode(encode(DecodeRequest("r", 0, task, "fp")))
        assert isinstance(back, DecodeRequest) and back.task.sampling.seed == seed


def test_int_is_accepted_where_float_is_expected_and_becomes_float() -> None:
    data = packed(TAG[DecodeRequest], "r", 0, raw_task([1, 1, 0, None, 0, 0, 1]), "fp", [], "")
    back = decode(data)
    assert isinstance(back, DecodeRequest)
    assert back.task.sampling.temperature == 1.0
    assert type(back.task.sampling.temperature) is float
    assert type(back.task.sampling.top_p) is float


def test_kv_header_codec_round_trips_inline_and_placed_headers() -> None:
    placed = Placement("cuda_ipc", "cuda-1-abc", 4096, 7, b"\x00\xffhandle")
    for placement in (None, placed):
        header = KVHeader("r", 0, 0, 2, 5, "bfloat16", [2, 5, 3, 64], 2**64 - 1, placement)
        assert FORWARD_CODEC.decode(FORWARD_CODEC.encode(header)) == header
    notice = KVNotice("r", 3, b"\x00\xffmeta")
    assert FORWARD_CODEC.decode(FORWARD_CODEC.encode(notice)) == notice
    wrong_placement = msgpack.packb([0, "r", 0, 0, 2, 5, "bfloat16", [2, 5, 3, 64], 1, "text"])
    wrong_meta = msgpack.packb([1, "r", 0, "text"])
    for wrong in (wrong_placement, wrong_meta):
        with pytest.raises(MalformedMessage):
            FORWARD_CODEC.decode(wrong)


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x92", b"\xdd\xff\xff\xff\xff", b"\x91" * 100_000,
    encode(Abort("r", 0)) + b"\x00",  # trailing bytes
    encode(Abort("r", 0))[:-1],  # truncated
], ids=["empty", "reserved", "short-array", "huge-array", "deep", "trailing", "truncated"])
def test_not_msgpack_is_malformed(data: bytes) -> None:
    assert_malformed(data)


@pytest.mark.parametrize("value", [
    None, 0, "abort", {"tag": 7}, [], b"\x07", 1.5, msgpack.ExtType(3, b"x"),
], ids=repr)
def test_top_level_that_is_not_a_tagged_array_is_malformed(value: Any) -> None:
    assert_malformed(msgpack.packb(value, use_bin_type=True))


@pytest.mark.parametrize("tag", [len(MESSAGE_TYPES), 99, -1, -(2**63), 2**64 - 1, "7", True, 7.0,
                                 None])
def test_unknown_or_mistyped_tag_is_malformed(tag: Any) -> None:
    assert_malformed(packed(tag, "r", 0))


@pytest.mark.parametrize("fields", [[], ["r"], ["r", 0, 1], ["r", 0, "x", "y"]], ids=repr)
def test_wrong_field_count_is_malformed(fields: list[Any]) -> None:
    assert_malformed(packed(TAG[Abort], *fields))


@pytest.mark.parametrize("fields", [
    ["r", "0"],  # str where int
    ["r", True],  # bool where int
    ["r", 1.0],  # float where int
    ["r", None],  # None where int is required
    [None, 0],  # None where str is required
    [b"r", 0],  # bytes where str
    [1, 0],  # int where str
    [["r"], 0],  # list where str
    ["r", [0]],  # list where int
    ["r", {"a": 1}],  # map where int
    ["r", msgpack.ExtType(1, b"")],  # ext where int
], ids=repr)
def test_wrong_field_type_is_malformed(fields: list[Any]) -> None:
    assert_malformed(packed(TAG[Abort], *fields))


def test_wrong_types_in_other_messages_are_malformed() -> None:
    assert_malformed(packed(TAG[RegisterReply], 1, ""))  # int where bool
    assert_malformed(packed(TAG[RegisterReply], None, ""))
    assert_malformed(packed(TAG[FirstToken], "r", 0, 5, 3))  # int where str | None
    assert_malformed(packed(TAG[FirstToken], "r", 0, None, None))
    assert_malformed(packed(TAG[Heartbeat], "w", "i", 1.5, 0, 0, 0))
    assert_malformed(packed(TAG[Register], "w", "i", "decode", "", "fp", "16", 1))


@pytest.mark.parametrize("message", [
    ["w", "i", "embed", "", "fp", 16, 1],  # Register: a role that is neither prefill nor decode
    ["w", "i", "Decode", "", "fp", 16, 1],
], ids=repr)
def test_a_role_outside_its_choices_is_malformed(message: list[Any]) -> None:
    assert_malformed(packed(TAG[Register], *message))


def test_a_finish_reason_outside_its_choices_is_malformed() -> None:
    assert_malformed(packed(TAG[FirstToken], "r", 0, 5, "banana", 0, None, [], [], b""))
    assert_malformed(packed(TAG[FirstToken], "r", 0, 5, 1, 0, None, [], [], b""))  # not text
    assert decode(encode(FirstToken("r", 0, 5, "length"))) == FirstToken("r", 0, 5, "length")


def test_a_transfer_total_names_a_known_backend() -> None:
    def heartbeat(backend: str) -> bytes:
        totals = [[backend, "send", 1, 1, 0.1, 0]]
        return packed(TAG[Heartbeat], "w", "i", 0, 0, 0, 0, 0, 0, 0, totals, [], 0, 0, 0, [], 0,
                      False, [0, 0, 0, 0, 0.0, 0.0], 0.0, 0.0)

    beat = decode(heartbeat("shm"))
    assert isinstance(beat, Heartbeat) and beat.transfers[0].backend == "shm"
    assert_malformed(heartbeat("rdma"))


def test_invalid_utf8_string_is_malformed() -> None:
    good = packed(TAG[Abort], "r", 0)
    bad = good.replace(b"\xa1r", b"\xa1\xff")
    assert bad != good
    assert_malformed(bad)


def test_non_string_map_key_is_malformed() -> None:
    assert_malformed(msgpack.packb([TAG[Abort], {1: 2}, 0]))


def _task_fields(**changes: Any) -> list[Any]:
    fields = {"prompt_ids": [1, 2], "sampling": [1.0, 1.0, 0, None], "max_tokens": 4,
              "stop_token_ids": [], "ignore_eos": False}
    return list({**fields, **changes}.values())


@pytest.mark.parametrize("task", [
    None,
    "task",
    {"prompt_ids": [1]},
    [[1, 2], [1.0, 1.0, 0, None], 4, []],  # a field short
    _task_fields(prompt_ids="12"),  # str where list
    _task_fields(prompt_ids=[1, "2"]),  # wrong item type
    _task_fields(prompt_ids=[1, None]),
    _task_fields(prompt_ids=[[1]]),
    _task_fields(sampling=None),  # None where a dataclass is required
    _task_fields(sampling=[1.0, 1.0, 0]),  # nested field count
    _task_fields(sampling=["hot", 1.0, 0, None]),  # nested field type
    _task_fields(sampling=[1.0, 1.0, 0, "seed"]),  # Optional[int] given a str
    _task_fields(sampling=[1.0, 1.0, 0, 1.5]),  # Optional[int] given a float
    _task_fields(ignore_eos=0),  # int where bool
], ids=repr)
def test_nested_wrong_shapes_are_malformed(task: Any) -> None:
    assert_malformed(packed(TAG[PrefillRequest], "r", 0, task, "d1", "addr", [], "", ""))


EVENT_REST: list[Any] = [None, None, [], [], 0, b""]  # a TokenEvent's fields after its token


@pytest.mark.parametrize("events", [
    None, "events", [None],
    [["r", 0, 7, None]],  # the old shape, without an index
    [["r", 0, 1, 7, None, None, [], [], 5, b"", 6]],  # a field too many
    [["r", 0, "1", 7, *EVENT_REST]],  # str where the index is
    [["r", 0, 1.0, 7, *EVENT_REST]],  # float where the index is
    [["r", 0, None, 7, *EVENT_REST]],  # no index
    [["r", 0, 1, "7", *EVENT_REST]],  # str where the token is
    [["r", 0, 1, 7, 0, *EVENT_REST[1:]]],  # int where the finish reason is
    [["r", 0, 1, 7, *EVENT_REST[:-1], [1.0]]],  # a list where the embedding's bytes are
    [["r", 0, 1, 7, *EVENT_REST], "x"], {"r": 1},
], ids=repr)
def test_malformed_token_batches_are_malformed(events: Any) -> None:
    assert_malformed(packed(TAG[TokenBatch], events))


class _CreatesAFile:
    """A pickle whose loading would create `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return open, (str(self.path), "w")


def test_pickle_payload_is_malformed_and_never_executed(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        payload = pickle.dumps(_CreatesAFile(target), protocol=protocol)
        assert_malformed(payload)
        assert_malformed(pickle.dumps(Abort("r", 0), protocol=protocol))
        assert not target.exists()
    pickle.loads(payload).close()  # the payload is live: loading it does create the file
    assert target.exists()


def _check_decodes_or_malformed(data: bytes) -> None:
    try:
        message = decode(data)
    except MalformedMessage:
        return
    assert isinstance(message, MESSAGE_TYPES)


def test_fuzz_random_bytes() -> None:
    rng = random.Random(1234)
    for _ in range(3000):
        _check_decodes_or_malformed(rng.randbytes(rng.randint(0, 64)))


def test_fuzz_mutated_messages() -> None:
    rng = random.Random(99)
    encoded = [encode(m) for m in SAMPLES]
    for _ in range(3000):
        data = bytearray(rng.choice(encoded))
        for _ in range(rng.randint(1, 4)):
            position = rng.randrange(len(data))
            if rng.random() < 0.2:
                del data[position:]
                break
            data[position] = rng.randrange(256)
        _check_decodes_or_malformed(bytes(data))


def test_a_codec_with_its_own_types() -> None:
    codec: Codec[Abort | RequestFailed] = Codec((RequestFailed, Abort))
    assert codec.decode(codec.encode(Abort("r", 1))) == Abort("r", 1)
    assert msgpack.unpackb(codec.encode(Abort("r", 1)))[0] == 1
    with pytest.raises(MalformedMessage):
        codec.decode(packed(2, "r", 1))


def test_a_token_batch_as_decode_sends_it_decodes() -> None:
    data = packed(TAG[TokenBatch], [["r", 0, 1, 7, None, None, [], [], 0, b""],
                                    ["r", 0, 0, 8, "stop", -0.5, [[8, -0.5]],
                                     [["first_decode", 0.25]], 16, b"\x00\x00\x80?"]])
    assert decode(data) == TokenBatch([TokenEvent("r", 0, 1, 7, None),
                                       TokenEvent("r", 0, 0, 8, "stop", -0.5,
                                                  [TopLogprob(8, -0.5)],
                                                  [StageTime("first_decode", 0.25)], 16,
                                                  b"\x00\x00\x80?")])


def test_leave_and_register_again_are_typed() -> None:
    assert decode(packed(TAG[Leave], "d1", "inst")) == Leave("d1", "inst")
    assert decode(packed(TAG[RegisterAgain], "why")) == RegisterAgain("why")
    assert_malformed(packed(TAG[Leave], "d1"))
    assert_malformed(packed(TAG[Leave], "d1", 7))
    assert_malformed(packed(TAG[RegisterAgain], None))


BAD_SAMPLINGS = [
    [-1.0, 1.0, 0, None],  # negative temperature
    [-1e-9, 1.0, 0, None],
    [float("nan"), 1.0, 0, None],
    [float("-inf"), 1.0, 0, None],
    [float("inf"), 1.0, 0, None],  # temperature must be finite
    [1.0, 0.0, 0, None],  # top_p must be above 0
    [1.0, -0.5, 0, None],
    [1.0, 1.0000001, 0, None],  # and at most 1
    [1.0, float("nan"), 0, None],
    [1.0, 1.0, -1, None],  # negative top_k
    [1.0, 1.0, 0, None, float("nan"), 0.0, 1.0, None],  # penalties must be finite
    [1.0, 1.0, 0, None, 0.0, float("-inf"), 1.0, None],
    [1.0, 1.0, 0, None, 0.0, 0.0, 0.0, None],  # a repetition penalty must be above 0
    [1.0, 1.0, 0, None, 0.0, 0.0, float("inf"), None],  # and finite
    [1.0, 1.0, 0, None, 0.0, 0.0, 1.0, -1],  # logprobs in [0, 20]
    [1.0, 1.0, 0, None, 0.0, 0.0, 1.0, 21],
    [1.0, 1.0, 0, None, 0.0, 0.0, 1.0, None, -0.1, None, []],  # min_p in [0, 1]
    [1.0, 1.0, 0, None, 0.0, 0.0, 1.0, None, 1.5, None, []],
    [1.0, 1.0, 0, None, 0.0, 0.0, 1.0, None, 0.0, [], []],  # allowed ids: None or some
    [1.0, 1.0, 0, None, 0.0, 0.0, 1.0, None, 0.0, None, [[]]],  # a bad word has tokens
    [1.0, 1.0, 0, None, 0.0, 0.0, 1.0, None, 0.0, None, [], [[5, float("nan")]]],  # finite bias
]


@pytest.mark.parametrize("sampling", BAD_SAMPLINGS, ids=repr)
def test_a_message_failing_its_own_validation_is_malformed(sampling: list[Any]) -> None:
    bad = packed(TAG[PrefillRequest], "r", 0, raw_task(sampling), "d", "", [], "", "")
    assert_malformed(bad)
    assert_malformed(packed(TAG[DecodeRequest], "r", 0, raw_task(sampling), "fp", [], ""))
    with pytest.raises(ValueError):
        sampling_of(sampling)


def sampling_of(raw: list[Any]) -> Sampling:
    """The Sampling whose msgpack fields `raw` lists."""
    biases = [TokenBias(*bias) for bias in raw[11]] if len(raw) > 11 else []
    return dataclasses.replace(Sampling(*raw[:11]), logit_bias=biases)


@pytest.mark.parametrize("sampling", [
    [0.0, 1.0, 0, None],  # greedy
    [0, 1, 0, None],  # ints where floats are expected
    [2.5, 1e-6, 0, 7],
    [2.0, 0.5, 1, None],
    [1.0, 1.0, 50_000, -3],
    [1.7976931348623157e308, 1.0, 0, None],  # the largest finite temperature
    [1.0, 1.0, 0, None, -2, 2, 3, 0],  # ints where floats are expected, penalties too
    [1.0, 1.0, 0, None, 1e300, -1e300, 1e-300, 20],
    [1.0, 1.0, 0, None, 0, 0, 1, None, 1, [0, 5], [[3], [4, 5]]],  # min_p, allowed, bad words
    [1.0, 1.0, 0, None, 0, 0, 1, None, 0, None, [], [[5, 100], [9, -2.5]]],  # logit_bias
], ids=repr)
def test_valid_sampling_at_the_edges_decodes(sampling: list[Any]) -> None:
    back = decode(packed(TAG[PrefillRequest], "r", 0, raw_task(sampling), "d", "", [], "", "",
                         "", 0))
    assert isinstance(back, PrefillRequest)
    assert back.task.sampling == sampling_of(sampling)
    assert back.task.sampling.greedy == (sampling[0] == 0)


@pytest.mark.parametrize(("min_tokens", "output_start"), [(-1, None), (0, -1), (0, 2)])
def test_a_task_failing_its_own_validation_is_malformed(min_tokens: int,
                                                        output_start: int | None) -> None:
    task = raw_task([1.0, 1.0, 0, None])
    task[6:8] = [min_tokens, output_start]
    assert_malformed(packed(TAG[DecodeRequest], "r", 0, task, "fp", [], ""))


def test_a_top_logprob_must_be_a_pair_of_id_and_number() -> None:
    good = packed(TAG[FirstToken], "r", 0, 5, None, 0, -1, [[5, -1]], [], b"")
    assert decode(good) == FirstToken("r", 0, 5, None, 0, -1.0, [TopLogprob(5, -1.0)])
    assert_malformed(packed(TAG[FirstToken], "r", 0, 5, None, 0, -1.0, [[5]], [], b""))
    assert_malformed(packed(TAG[FirstToken], "r", 0, 5, None, 0, -1.0, [["5", -1.0]], [], b""))
    assert_malformed(packed(TAG[FirstToken], "r", 0, 5, None, 0, "low", [], [], b""))


def test_an_embedding_must_be_bytes() -> None:
    vector = b"\x00\x00\x80?\x00\x00\x00@"  # 1.0, 2.0
    first = decode(packed(TAG[FirstToken], "r", 0, 5, "length", 0, None, [], [], vector))
    assert isinstance(first, FirstToken) and first.embedding == vector
    assert_malformed(packed(TAG[FirstToken], "r", 0, 5, "length", 0, None, [], [], [1.0, 2.0]))
    assert_malformed(packed(TAG[FirstToken], "r", 0, 5, "length", 0, None, [], [], "text"))


@pytest.mark.parametrize("temperature", [float("inf"), float("-inf"), float("nan")], ids=repr)
def test_a_non_finite_temperature_is_refused_and_says_why(temperature: float) -> None:
    with pytest.raises(ValueError, match="finite"):
        Sampling(temperature=temperature)
    assert Sampling(temperature=1e300).temperature == 1e300


@pytest.mark.parametrize("stage", [
    ["prefill_wait", -0.001],  # a duration below zero
    ["prefill_wait", float("nan")], ["prefill_wait", float("inf")],
    ["lunch", 0.1],  # not a stage
    ["prefill_wait", "0.1"], ["prefill_wait"], [None, 0.1],
], ids=repr)
def test_a_stage_must_be_a_known_name_and_a_finite_duration(stage: list[Any]) -> None:
    assert_malformed(packed(TAG[FirstToken], "r", 0, 5, None, 0, None, [], [stage], b""))
    event = ["r", 0, 1, 7, None, None, [], [stage], 0, b""]
    assert_malformed(packed(TAG[TokenBatch], [event]))
