"""Structured output in the engine: a grammar's mask keeps only the tokens it allows, lets the
sequence end only where the JSON value is complete, and alone makes a random model's output
valid JSON matching the schema."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from core.messages import JSON_OBJECT, GenerationTask, Grammar, Sampling
from engine.sampling.grammar import Constraint, GrammarError, Grammars, unpack_bitmask
from engine.sampling.sampler import History, draw, make_generator
from engine.weights.tokenizer import decode_text
from tests.openmp_probe import needs_two_cpus, probe

ROOT = Path(__file__).resolve().parents[3]
EOS = 2  # the tiny model's (and the real tokenizer's) EOS
SCHEMA: dict[str, object] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                           "vip": {"type": "boolean"}},
            "required": ["age", "vip"],
        },
    },
    "required": ["name", "kind", "tags", "owner"],
}
ONLY = {"type": "object", "properties": {"k": {"enum": ["v"]}}, "required": ["k"]}
ONLY_TEXT = '{"k": "v"}'
PROMPTS = ["Once upon a time", "The quick brown fox", "def fibonacci(n):"]
MAX_TOKENS = 200


def schema(value: dict[str, Any]) -> Grammar:
    return Grammar("json_schema", json.dumps(value))


def task(grammar: Grammar | None, prompt: list[int] | None = None, output: Sequence[int] = (),
         **fields: Any) -> GenerationTask:
    """A task with `output` already streamed (a resumed request) when given."""
    prompt = prompt or [1, 5, 6]
    fields = {"stop_token_ids": [], "ignore_eos": False, **fields}
    return GenerationTask(prompt_ids=[*prompt, *output], sampling=Sampling(), max_tokens=64,
                          output_start=len(prompt), grammar=grammar, **fields)


def constraint(grammars: Grammars, grammar: Grammar, output: Sequence[int] = (),
               **fields: Any) -> Constraint:
    made = grammars.constraint(task(grammar, output=output, **fields), (EOS,))
    assert made is not None
    return made


def allowed_ids(c: Constraint) -> set[int]:
    mask = c.allowed()
    assert mask is not None, "without a thought to wait out, a grammar always masks"
    return set(mask.nonzero().flatten().tolist())


def test_no_grammar_no_constraint(grammars: Grammars) -> None:
    assert grammars.constraint(task(None), (EOS,)) is None


def test_unpack_bitmask_reads_bits_in_token_order() -> None:
    bitmask = torch.tensor([1 - 2**31, 0b110], dtype=torch.int32)  # bits 0 and 31; 1 and 2
    assert unpack_bitmask(bitmask, 40).nonzero().flatten().tolist() == [0, 31, 33, 34]


def test_mask_keeps_only_tokens_that_start_an_object(
        grammars: Grammars, tokenizer: PreTrainedTokenizerBase) -> None:
    allowed = allowed_ids(constraint(grammars, JSON_OBJECT))
    assert allowed and EOS not in allowed
    assert all(decode_text(tokenizer, [t]).startswith("{") for t in allowed)
    # The draw picks an allowed token even where every allowed one is the least likely.
    logits = torch.zeros(3, 49152)
    logits[:, sorted(allowed)] = -50.0
    mask = constraint(grammars, JSON_OBJECT).allowed()
    params = [Sampling(temperature=0.0), Sampling(temperature=1.0), Sampling(top_k=5, top_p=0.5)]
    draws = draw(logits, params, [make_generator(s) for s in range(3)],
                 [History(allowed=mask)] * 3)
    assert all(d.token_id in allowed for d in draws)


def test_eos_only_once_the_value_is_complete(
        grammars: Grammars, tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode(ONLY_TEXT)
    c = constraint(grammars, schema(ONLY))
    for token in ids:
        assert EOS not in allowed_ids(c) and token in allowed_ids(c)
        c.advance(token)
    assert allowed_ids(c) == {EOS}


def test_a_resumed_request_starts_after_its_output(
        grammars: Grammars, tokenizer: PreTrainedTokenizerBase) -> None:
    c = constraint(grammars, schema(ONLY), output=tokenizer.encode(ONLY_TEXT))
    assert allowed_ids(c) == {EOS}


def test_stop_tokens_end_the_grammar_and_stay_after_it(
        grammars: Grammars, tokenizer: PreTrainedTokenizerBase) -> None:
    """With ignore_eos, the grammar ends on the request's stop tokens, and only they follow."""
    c = constraint(grammars, schema(ONLY), stop_token_ids=[7], ignore_eos=True)
    for token in tokenizer.encode(ONLY_TEXT):
        c.advance(token)
    assert allowed_ids(c) == {7}
    c.advance(7)
    assert allowed_ids(c) == {7}


def test_the_min_tokens_ban_yields_to_a_finished_grammar() -> None:
    mask = torch.zeros(10, dtype=torch.bool)
    mask[EOS] = True
    logits = torch.zeros(1, 10)
    hist = History(banned=(EOS,), allowed=mask)
    assert draw(logits, [Sampling(temperature=0.0)], [make_generator(0)], [hist])[0].token_id == EOS
    mask[4] = True
    assert draw(logits, [Sampling(temperature=0.0)], [make_generator(0)], [hist])[0].token_id == 4


@pytest.mark.parametrize("bad", [{"type": "bogus"}, {"type": "string", "pattern": "[a"}])
def test_a_bad_schema_is_a_grammar_error(grammars: Grammars, bad: dict[str, object]) -> None:
    with pytest.raises(GrammarError):
        grammars.constraint(task(schema(bad)), (EOS,))


def test_compiled_grammars_are_cached(grammars: Grammars) -> None:
    assert grammars.compiled(schema(SCHEMA)) is grammars.compiled(schema(SCHEMA))


@pytest.fixture(scope="module")
def generate(tiny_model_dir: Path, grammars: Grammars, tokenizer: PreTrainedTokenizerBase
             ) -> Callable[[str, Grammar, Sampling], tuple[str, bool]]:
    """The tiny random model's constrained output text for a prompt, and whether EOS ended it
    within MAX_TOKENS."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()

    @torch.inference_mode()
    def run(prompt: str, grammar: Grammar, params: Sampling) -> tuple[str, bool]:
        c = constraint(grammars, grammar)
        generator, output = make_generator(params.seed), list[int]()
        out = model(torch.tensor([tokenizer.encode(prompt)]), use_cache=True)
        for _ in range(MAX_TOKENS):
            token = draw(out.logits[:, -1], [params], [generator],
                         [History(allowed=c.allowed())])[0].token_id
            if token == EOS:
                return decode_text(tokenizer, output), True
            c.advance(token)
            output.append(token)
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values,
                        use_cache=True)
        return decode_text(tokenizer, output), False

    return run


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("params", [Sampling(temperature=0.0), Sampling(seed=1),
                                    Sampling(temperature=0.7, top_p=0.9, seed=2)])
def test_a_random_model_writes_valid_json_under_the_schema(
        generate: Callable[[str, Grammar, Sampling], tuple[str, bool]], prompt: str,
        params: Sampling) -> None:
    """Bounded strings, enums and arrays: the grammar alone must make it end, and valid."""
    text, ended = generate(prompt, schema(SCHEMA), params)
    assert ended, text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_a_random_model_writes_json_objects(
        generate: Callable[[str, Grammar, Sampling], tuple[str, bool]]) -> None:
    """Any object: nothing bounds a random model's strings, but what ends is an object."""
    settings = [(prompt, Sampling(temperature=0.0)) for prompt in PROMPTS]
    runs = [generate(prompt, JSON_OBJECT, params)
            for prompt, params in [*settings, (PROMPTS[1], Sampling(seed=3))]]
    assert any(ended for _, ended in runs)
    assert all(isinstance(json.loads(text), dict) for text, ended in runs if ended)


@pytest.mark.parametrize(("grammar", "pattern"), [
    (Grammar("regex", r"[0-9]{3}-[a-z]{2,4}"), r"[0-9]{3}-[a-z]{2,4}"),
    (Grammar("ebnf", 'root ::= "yes" | "no" | "maybe, then\\nno"'), r"yes|no|maybe, then\nno"),
    (Grammar("regex", r"(line\n){2}end"), r"(line\n){2}end"),  # a control byte is allowed
])
def test_a_random_model_writes_what_a_regex_or_ebnf_grammar_says(
        generate: Callable[[str, Grammar, Sampling], tuple[str, bool]], grammar: Grammar,
        pattern: str) -> None:
    for prompt, params in [(PROMPTS[0], Sampling(temperature=0.0)), (PROMPTS[1], Sampling(seed=5))]:
        text, ended = generate(prompt, grammar, params)
        assert ended and re.fullmatch(pattern, text), text


def test_no_raw_control_character_inside_a_string(
        grammars: Grammars, tokenizer: PreTrainedTokenizerBase) -> None:
    """JSON allows none unescaped, though xgrammar's string rule lets them in (a random model
    once wrote a \\x01 into a name)."""
    c = constraint(grammars, schema(SCHEMA))
    for token in tokenizer.encode('{"name": "ab'):
        c.advance(token)
    allowed = allowed_ids(c)
    control = {t for t in allowed if any(ch < " " for ch in decode_text(tokenizer, [t]))}
    assert allowed and control == set()
    assert grammars.control_tokens[tokenizer.convert_tokens_to_ids("ā")]  # byte 0x01


def tool_calls_schema(tools: int, params: int) -> dict[str, Any]:
    """What `tool_choice: required` asks for: an array of {"name": const, "arguments": {...}}
    calls, one anyOf branch per tool."""
    def call(i: int) -> dict[str, Any]:
        arguments = {"type": "object", "additionalProperties": False,
                     "properties": {f"p{j}": {"type": "string", "maxLength": 8}
                                    for j in range(params)},
                     "required": [f"p{j}" for j in range(params)]}
        return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": f"tool_{i}"}, "arguments": arguments}}
    return {"type": "array", "minItems": 1, "items": {"anyOf": [call(i) for i in range(tools)]}}


def test_a_grammar_compiles_off_the_callers_thread_and_is_cached(
        tiny_model_dir: Path) -> None:
    fresh = Grammars(tiny_model_dir, vocab_size=49152)
    try:
        text = schema(tool_calls_schema(40, 4))
        future = fresh.prepare(text)
        # The vocabulary tables alone take a while: the caller is back long before.
        assert not future.done() and not fresh.ready(text)
        future.result(timeout=120)
        assert fresh.ready(text) and fresh.prepare(text) is future
        assert fresh.problem(text) is None
        assert fresh.constraint(task(text), (EOS,)) is not None
    finally:
        fresh.close()


def test_warm_tables_are_built_once_at_the_lowest_priority_off_the_exit_path(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[tuple[int, bool]] = []
    build = Grammars._build_tables

    def recorded(grammars: Grammars) -> Any:
        builds.append((os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                       threading.current_thread().daemon))
        return build(grammars)

    monkeypatch.setattr(Grammars, "_build_tables", recorded)
    fresh = Grammars(tiny_model_dir, vocab_size=49152)
    try:
        fresh.warm_up()
        fresh.warm_up()
        assert fresh.prepare(JSON_OBJECT).result(timeout=120) is not None
        assert builds == [(19, True)]  # the grammar waited for the warm tables
    finally:
        fresh.close()


def test_a_bad_grammar_is_ready_with_its_problem(grammars: Grammars) -> None:
    text = schema({"type": "object", "properties": {"a": {"type": "no-such-type"}}})
    grammars.prepare(text).exception(timeout=120)
    problem = grammars.problem(text)
    assert grammars.ready(text) and problem is not None and problem.startswith("invalid grammar")


def test_the_cache_forgets_the_least_recently_used_grammar(tiny_model_dir: Path) -> None:
    small = Grammars(tiny_model_dir, vocab_size=49152, cache_size=2)
    try:
        first, second, third = (schema({"enum": [name]}) for name in "abc")
        kept = small.prepare(first)
        small.prepare(second)
        assert small.prepare(first) is kept  # used again: the most recent now
        small.prepare(third)  # evicts `second`
        assert small.prepare(first) is kept and small.prepare(second).result(timeout=120)
    finally:
        small.close()


def test_a_long_compile_lets_other_threads_run(grammars: Grammars) -> None:
    """xgrammar compiles in C++ with the GIL released: a thread of the worker's (its
    heartbeats) keeps running, in steps far shorter than the heartbeat interval."""
    grammars.compiled(schema(ONLY))  # the tables built
    future = grammars.prepare(schema(tool_calls_schema(200, 8)))
    ticks = []
    while not future.done():
        ticks.append(time.monotonic())
        time.sleep(0.01)
    gaps = [later - earlier for earlier, later in itertools.pairwise(ticks)]
    assert len(ticks) > 10 and max(gaps) < 0.5, (len(ticks), max(gaps, default=0))


# A fresh worker's Grammars: what it imported when made, then how long the process's main thread
# went unscheduled while the first grammar imported xgrammar and built the tables
FIRST_GRAMMAR = """
import itertools, json, sys, time
from pathlib import Path
from core.messages import JSON_OBJECT
from engine.sampling.grammar import Grammars
grammars = Grammars(Path({folder!r}), vocab_size=49152)
imported = sorted(name for name in ("xgrammar", "transformers") if name in sys.modules)
future, ticks = grammars.prepare(JSON_OBJECT), []
while not future.done():
    ticks.append(time.monotonic())
    time.sleep(0.01)
future.result()
gaps = [later - earlier for earlier, later in itertools.pairwise(ticks)]
print(json.dumps({{"imported": imported, "ticks": len(ticks), "gap": max(gaps, default=0)}}))
"""


def test_the_first_grammar_brings_in_xgrammar_off_the_loop(tiny_model_dir: Path) -> None:
    """A worker imports xgrammar and its tokenizer (transformers: seconds of a CPU) and builds
    the tables only once a grammar comes; the loop's thread runs all the while."""
    done = subprocess.run([sys.executable, "-c", FIRST_GRAMMAR.format(folder=str(tiny_model_dir))],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["imported"] == [], result
    assert result["ticks"] > 10 and result["gap"] < 0.5, result


# A worker's grammar thread, its tables built and a grammar compiled
GRAMMAR_THREAD = """
from pathlib import Path
from core.messages import JSON_OBJECT
from engine.sampling.grammar import Grammars
grammars = Grammars(Path({folder!r}), vocab_size=49152)
grammars.prepare(JSON_OBJECT).result(timeout=120)
assert grammars.control_tokens.any()
"""


@needs_two_cpus
def test_the_grammar_thread_leaves_the_loops_threads_spinning(tiny_model_dir: Path) -> None:
    """Workers' threads spin between parallel regions (core/threads.py). A torch op on the
    grammar thread would start a second OpenMP team there, and libgomp, with more threads than
    CPUs, would cut every spin to 1,000 rounds: the loop's threads would sleep after every
    parallel region (a decode step of one stream 9.3 to 15.4 ms). Spinning without end here,
    the threads sleep only where libgomp cuts the spin, however busy the machine is."""
    waits = probe(GRAMMAR_THREAD.format(folder=str(tiny_model_dir)), OMP_WAIT_POLICY="ACTIVE")
    assert waits.sleeps < 40, waits  # of 400 regions
