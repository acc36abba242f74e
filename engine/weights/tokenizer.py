"""A model folder's tokenizer, loaded without torch.

transformers' AutoTokenizer reads the model's config to pick the tokenizer class, and that
imports torch (~1 s, ~300 MB) into a process that may never need it: the gateway. Every
tokenizer with a `tokenizer.json` is a `TokenizersBackend` in transformers 5, and the class
`tokenizer_config.json` names is loaded here directly, as AutoTokenizer would load it. Anything
else (a slow, sentencepiece-only tokenizer) goes through AutoTokenizer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import transformers
from tokenizers import Tokenizer
from transformers.tokenization_utils_tokenizers import TokenizersBackend

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of the model folder `folder`."""
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    name = config.get("tokenizer_class") or "TokenizersBackend"
    tokenizer_class = getattr(transformers, name, None)
    if (folder / "tokenizer.json").exists() and isinstance(tokenizer_class, type) \
            and issubclass(tokenizer_class, TokenizersBackend):
        return tokenizer_class.from_pretrained(folder)
    log.info("%s: tokenizer class %r has no fast tokenizer here: AutoTokenizer loads it", folder,
             name)
    return transformers.AutoTokenizer.from_pretrained(folder)


def decode_text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int],
                skip_special_tokens: bool = False) -> str:
    """The text of one sequence of token ids (transformers' `decode` is typed for batches too).
    Straight from the `tokenizers` backend where transformers would only wrap it: the gateway
    decodes each streamed token twice, and the wrapper cost ten times the decoding."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, Tokenizer) and not tokenizer.clean_up_tokenization_spaces:
        return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
    text = tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str), "one sequence of ids decodes to one string"
    return text
