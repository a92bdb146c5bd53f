"""Paged KV-cache block manager with prefix caching.

Blocks are fixed-size pages of the per-layer KV tensors. Each request owns a block table; a
block's ref count says how many requests hold it. Full blocks are keyed by a hash of their whole
token prefix (parent hash + the block's tokens), so requests sharing a system prompt, a tool list
or the earlier turns of an agent conversation reuse them. A block whose ref count drops to zero
goes to the tail of the free queue but keeps its hash: it can still be hit until it is reused,
which evicts it (LRU). Invariant: every block is either held (ref > 0) or in the free queue.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class NoFreeBlocksError(RuntimeError):
    pass


def hash_block(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent_hash, tokens))


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from cached blocks

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = evicted first); values unused.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---------------------------------------------------------------- allocation

    def _take_free(self) -> Block:
        if not self.free:
            raise NoFreeBlocksError("KV cache is full")
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached content
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block

    def _hold(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def match_prefix(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Longest run of cached full blocks for this prefix -> (block ids, their hashes).
        At least one token is always left to compute (its logits are needed)."""
        ids: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return ids, hashes
        parent = None
        max_blocks = (len(token_ids) - 1) // self.block_size
        for b in range(max_blocks):
            h = hash_block(parent, tuple(token_ids[b * self.block_size:(b + 1) * self.block_size]))
            block_id = self.cached.get(h)
            if block_id is None:
                break
            ids.append(block_id)
            hashes.append(h)
            parent = h
        return ids, hashes

    def acquire_prefix(self, block_ids: list[int], num_prompt_tokens: int) -> None:
        for b in block_ids:
            self._hold(b)
        self.stats.queries += num_prompt_tokens
        self.stats.hits += len(block_ids) * self.block_size

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free):
            raise NoFreeBlocksError(f"need {num_blocks} KV blocks, {len(self.free)} free")
        return [self._take_free().block_id for _ in range(num_blocks)]

    def free_blocks(self, block_ids: list[int]) -> None:
        # Release tail blocks first so they are evicted before the shared head of the prefix.
        for b in reversed(block_ids):
            block = self.blocks[b]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[b] = None

    def register_full_block(self, block_id: int, parent_hash: int | None, tokens: tuple[int, ...]) -> int:
        """Key a block that just became full (its KV valid) by its prefix; returns the hash."""
        h = hash_block(parent_hash, tokens)
        if self.enable_prefix_caching:
            block = self.blocks[block_id]
            block.block_hash = h
            self.cached.setdefault(h, block_id)
        return h

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.cached.values()):
            self.blocks[block_id].block_hash = None
        self.cached.clear()

    def check_invariants(self) -> None:
        """Every block is held or free, never both; cached hashes point at live hashes."""
        for block in self.blocks:
            in_free = block.block_id in self.free
            if block.ref_count < 0 or (block.ref_count == 0) != in_free:
                raise AssertionError(f"block {block.block_id}: ref_count={block.ref_count}, free={in_free}")
        for h, b in self.cached.items():
            if self.blocks[b].block_hash != h:
                raise AssertionError(f"cache entry for block {b} is stale")
