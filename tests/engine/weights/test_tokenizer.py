"""The tokenizer loaded without torch is the one AutoTokenizer loads, call for call."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.weights.tokenizer import decode_text, load_tokenizer

ROOT = Path(__file__).resolve().parents[3]
TEXTS = ["Hello, world!", "  two  spaces and a tab\t", "日本の首都は東京です。",
         "def f(x):\n    return x", "<|im_start|>user\nHi<|im_end|>", "émoji 🙂 and café"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And?"}]


@pytest.mark.parametrize("folder_fixture", ["tiny_model_dir", "real_model_dir"])
def test_it_encodes_decodes_and_templates_as_auto_tokenizer(
        folder_fixture: str, request: pytest.FixtureRequest) -> None:
    folder: Path = request.getfixturevalue(folder_fixture)
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(theirs) and len(ours) == len(theirs)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        assert decode_text(ours, ids) == theirs.decode(ids)
        assert decode_text(ours, ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True)
    assert ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == \
        theirs.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


def test_any_ids_decode_as_transformers_decodes_them(real_model_dir: Path) -> None:
    """Straight from the backend, as the wrapper does it: cut characters, special tokens."""
    ours, theirs = load_tokenizer(real_model_dir), AutoTokenizer.from_pretrained(real_model_dir)
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.randrange(len(theirs)) for _ in range(rng.randint(1, 12))]
        for skip in (False, True):
            assert decode_text(ours, ids, skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_a_class_transformers_lacks_is_left_to_auto_tokenizer(tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    for path in tiny_model_dir.iterdir():
        if path.name != "tokenizer_config.json":
            (tmp_path / path.name).symlink_to(path)
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "NoSuchTokenizer"}))
    ours, theirs = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert type(ours) is type(theirs)
    assert all(ours.encode(text) == theirs.encode(text) for text in TEXTS)


def test_loading_it_imports_no_torch(tiny_model_dir: Path) -> None:
    script = ("import sys; from engine.weights.tokenizer import load_tokenizer, decode_text; "
              f"t = load_tokenizer({str(tiny_model_dir)!r}); decode_text(t, t.encode('hi')); "
              "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
