"""Chained hashes of full KV blocks: what the prefix cache keys its blocks by.

Block i's hash covers block i's token ids and block i-1's hash, so equal hashes mean equal
prefixes, not only equal blocks. The chain starts from the request's cache salt (its tenant):
tenants never share a block, and so can never learn from cache hits what another one sent.

SHA-256 rather than a fast non-cryptographic hash (xxh3): a tenant's salt is derived from its
name, which others may guess, so a hash that can be steered into collisions would let one
tenant's crafted prompt claim another tenant's cached block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_ROOT_DOMAIN = b"raging-block-hash-v1\0"
TOKEN_BYTES = 4  # each token id as an unsigned 32-bit little-endian integer


def chain_root(salt: str) -> bytes:
    """The hash the chain starts from: block 0's "previous block"."""
    return hashlib.sha256(_ROOT_DOMAIN + salt.encode()).digest()


def block_hash(previous: bytes, tokens: Sequence[int]) -> bytes:
    """One block's hash, over the previous block's hash and this block's token ids."""
    # Fixed-size fields (a 32-byte hash, 4 bytes per token) make the encoding unambiguous.
    return hashlib.sha256(previous + struct.pack(f"<{len(tokens)}I", *tokens)).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str) -> list[bytes]:
    """The chained hash of every FULL block of `token_ids`; a partial last block has none."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[bytes] = []
    previous = chain_root(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = block_hash(previous, token_ids[start:start + block_size])
        hashes.append(previous)
    return hashes
