"""Prefix-cache block hashes: the one function the engine and the request router share.

A full block's hash is SHA-256 over its parent's hash and its token ids, so it names the block's
whole prefix: two requests share a cached block only if a SHA-256 collision says otherwise. (A
plain tuple hash is unkeyed and can be inverted step by step: a client could craft a prompt whose
blocks collide with another tenant's and be served their KV.) The chain starts from a root that
covers everything else that changes the KV: the model and the request's `cache_salt`, so tenants
with different salts never share blocks, nor the timing a cache hit would reveal.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Iterator, List, Optional, Sequence

BlockHash = bytes  # 32-byte SHA-256 digest
_VERSION = b"iterserve-kv-block-v1\0"


ROUTING_KEY_BYTES = 8


def routing_key(h: BlockHash) -> bytes:
    """A block hash shortened for what request routers keep and replicas report (router.index, the
    eviction reports): 8 bytes tell a block from millions of others with odds of a collision near
    1e-7, and a collision would only mislead one routing decision; the engine's cache matches whole
    hashes."""
    return h[:ROUTING_KEY_BYTES]


def first_routed_block(start: int, stride: int) -> int:
    """The first block at or after block `start` of a chain (0: the root's child) that request routers
    key at `stride`: blocks stride-1, 2*stride-1, ..., each naming its whole prefix (router.index keeps
    them; the eviction log reports only them)."""
    return start + (stride - 1 - start) % stride


def root_hash(model: str, cache_salt: Optional[str] = None, adapter: Optional[str] = None) -> BlockHash:
    """The parent of a sequence's first block. `adapter`: the LoRA adapter's cache id
    (adapter_cache_id), None for the base model: an adapter changes every layer's K/V."""
    h = hashlib.sha256(_VERSION)
    h.update(model.encode())
    if cache_salt is not None:  # length-prefixed: no model/salt pair can spell another
        h.update(b"\0salt\0%d\0" % len(cache_salt) + cache_salt.encode())
    if adapter is not None:
        h.update(b"\0lora\0%d\0" % len(adapter) + adapter.encode())
    return h.digest()


def adapter_cache_id(name: str, digest: str) -> str:
    """What roots an adapter's blocks: its name and its weights' digest, so an adapter reloaded under
    the same name with other weights never reuses the old K/V."""
    return f"{name}@{digest}"


def iter_block_hashes(
    token_ids: Sequence[int], block_size: int, num_blocks: int, root: BlockHash, known: Sequence[BlockHash] = ()
) -> Iterator[BlockHash]:
    """Hashes of full blocks len(known)..num_blocks-1 of `token_ids`, chained on from `known`, the
    hashes of its first blocks (already computed: a sequence's, a prompt's), or from `root`."""
    start = len(known)
    if start >= num_blocks:
        return
    parent = known[-1] if known else root
    # int64 ids, packed once for the blocks hashed here (not the whole sequence every step).
    packed = array("q", token_ids[start * block_size : num_blocks * block_size]).tobytes()
    step = block_size * 8
    for offset in range(0, len(packed), step):
        parent = hashlib.sha256(parent + packed[offset : offset + step]).digest()
        yield parent


def cacheable_block_hashes(
    token_ids: Sequence[int], block_size: int, root: BlockHash, known: Sequence[BlockHash] = ()
) -> List[BlockHash]:
    """Hashes of the blocks of `token_ids` a prefix-cache lookup can hit: the full blocks before the
    last token (whose logits must be computed). Also what a finished sequence leaves cached: every
    token but the last sampled one was computed. `known`: hashes of its first blocks, not recomputed
    (a prompt's, when hashing prompt + answer)."""
    num_blocks = (len(token_ids) - 1) // block_size
    head = list(known[:num_blocks])
    return head + list(iter_block_hashes(token_ids, block_size, num_blocks, root, head))
