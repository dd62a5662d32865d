"""Paged KV memory: fixed-size blocks, a free list, reference counts, prefix hashing.

Instead of reserving max_len slots per request, a request holds a *block table*: the ids
of the blocks its tokens live in, one block per `block_size` tokens, taken from a shared
pool as it grows. Token i of a sequence lives in block block_table[i // block_size] at
offset i % block_size; its *slot* (row in the flat pool) is block_id * block_size + offset.

Blocks are reference counted so several sequences can share one (a common prompt prefix,
or n samples of one prompt); a shared block is copied before it is written (copy-on-write).
With prefix caching, every full block is named by a chained hash of (parent block's hash,
its token ids); a freed block keeps its name and contents until it is reused, so a later
request with the same prefix finds it (least recently freed blocks are evicted first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class OutOfBlocksError(RuntimeError):
    """The pool has no free block left."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its tokens are known
    token_ids: tuple = ()  # kept to rule out hash collisions


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks of block_size slots that num_tokens tokens occupy: ceil(num_tokens / block_size), without floats."""
    return -(-num_tokens // block_size)


def block_hash(parent_hash: int | None, token_ids) -> int:
    """Chained hash: a block's name depends on every token before it, not just its own."""
    return hash((parent_hash, tuple(token_ids)))


class BlockAllocator:
    """A pool of `num_blocks` blocks of `block_size` token slots each."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (least recently freed first); cached ones keep their hash.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id, for full blocks with known tokens
        self.copy_on_write_log: list[tuple[int, int]] = []  # (src, dst) copies the KV store must do
        self.hits = self.queries = 0

    # ------------------------------------------------------------ accounting
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_needed(num_tokens, self.block_size)

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold this block (0: it is free)."""
        return self.blocks[block_id].ref_count

    def is_cached(self, block_id: int) -> bool:
        """Is this block in the prefix cache: would a later prompt with its prefix find it?"""
        block = self.blocks[block_id]
        return block.hash is not None and self.cached.get(block.hash) == block_id

    # ------------------------------------------------------------ primitives
    def take_free_block(self) -> Block:
        """The least recently freed block, now held once (ref_count 1), its old name dropped."""
        if not self.free:
            raise OutOfBlocksError("no free KV block left")
        block_id, _ = self.free.popitem(last=False)  # evict the least recently freed
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block

    def _share(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]  # a cached block comes back from the free list
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """Drop one reference; a block nobody holds goes to the end of the free list."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} freed twice")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None  # most recently freed: evicted last

    def _register_full_block(self, block: Block, parent_hash: int | None, token_ids) -> None:
        if not self.enable_prefix_caching:
            return
        block.hash, block.token_ids = block_hash(parent_hash, token_ids), tuple(token_ids)
        self.cached.setdefault(block.hash, block.block_id)

    # ------------------------------------------------------------ sequences
    def can_allocate(self, token_ids) -> bool:
        """Could a new sequence with these tokens get its blocks right now?"""
        cached = self._cached_prefix_blocks(token_ids)
        reusable_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return self.blocks_needed(len(token_ids)) - len(cached) + reusable_free <= self.num_free

    def _cached_prefix_blocks(self, token_ids) -> list[int]:
        """Ids of cached blocks holding a prefix of token_ids (full blocks, not the last token's)."""
        if not self.enable_prefix_caching:
            return []
        found, parent = [], None
        # Keep at least one token to compute: its logits are needed to sample the next token.
        for start in range(0, len(token_ids) - 1 - (len(token_ids) - 1) % self.block_size, self.block_size):
            chunk = tuple(token_ids[start : start + self.block_size])
            h = block_hash(parent, chunk)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:  # miss or collision
                break
            found.append(block_id)
            parent = h
        return found

    def allocate(self, token_ids) -> tuple[list[int], int]:
        """Blocks for a new sequence's tokens -> (block table, number of tokens already cached)."""
        if not self.can_allocate(token_ids):
            raise OutOfBlocksError(f"{self.blocks_needed(len(token_ids))} blocks needed, {self.num_free} free")
        cached = self._cached_prefix_blocks(token_ids)
        full_blocks = len(token_ids) // self.block_size
        self.queries += full_blocks
        self.hits += len(cached)
        table, parent = [], None
        for block_id in cached:
            self._share(block_id)
            table.append(block_id)
            parent = self.blocks[block_id].hash
        for index in range(len(cached), self.blocks_needed(len(token_ids))):
            block = self.take_free_block()
            chunk = token_ids[index * self.block_size : (index + 1) * self.block_size]
            if len(chunk) == self.block_size:
                self._register_full_block(block, parent, chunk)
                parent = block.hash
            table.append(block.block_id)
        return table, len(cached) * self.block_size

    def can_append(self, block_table: list[int], num_tokens: int) -> bool:
        """Can a sequence holding num_tokens grow by one token?"""
        needs_new = num_tokens % self.block_size == 0
        needs_copy = not needs_new and self.blocks[block_table[-1]].ref_count > 1
        return self.num_free >= int(needs_new or needs_copy)

    def append_slot(self, block_table: list[int], token_ids) -> None:
        """Make room for token len(token_ids) - 1 (just appended to token_ids), in place.

        Takes a new block when the last one is full, copies the last block first when it
        is shared (copy-on-write, recorded in copy_on_write_log), and names a block that
        this token fills up.
        """
        position = len(token_ids) - 1
        if position // self.block_size == len(block_table):
            block_table.append(self.take_free_block().block_id)
        self.copy_on_write(block_table)
        last = self.blocks[block_table[-1]]
        if (position + 1) % self.block_size == 0:
            parent = self.blocks[block_table[-2]].hash if len(block_table) > 1 else None
            self._register_full_block(last, parent, token_ids[position + 1 - self.block_size : position + 1])

    def reserve(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow a table to hold num_tokens slots for tokens not known yet (speculative drafts):
        no block is named. Copies a shared last block first. False (and no change) if the
        pool is too small."""
        extra = self.blocks_needed(num_tokens) - len(block_table)
        shared_tail = bool(block_table) and self.blocks[block_table[-1]].ref_count > 1
        if extra + int(shared_tail) > self.num_free:
            return False
        if shared_tail:
            self.copy_on_write(block_table)
        for _ in range(max(0, extra)):
            block_table.append(self.take_free_block().block_id)
        return True

    def shrink(self, block_table: list[int], token_ids, num_computed: int) -> None:
        """Keep just the blocks that token_ids occupy (rejected drafts are gone), and name the
        blocks filled by computed tokens, so the prefix cache can find them."""
        keep = self.blocks_needed(len(token_ids))
        while len(block_table) > keep:
            self.release(block_table.pop())
        parent = None
        for index, block_id in enumerate(block_table[: num_computed // self.block_size]):
            block = self.blocks[block_id]
            if block.hash is None:
                chunk = token_ids[index * self.block_size : (index + 1) * self.block_size]
                self._register_full_block(block, parent, chunk)
            parent = block.hash

    def copy_on_write(self, block_table: list[int]) -> bool:
        """Give a sequence its own copy of a shared last block before it writes there
        (`copy_on_write_last_block`; a subclass may swap in another version)."""
        return copy_on_write_last_block(self, block_table)

    def fork(self, block_table: list[int]) -> list[int]:
        """A second sequence sharing every block of this one (n > 1 samples of one prompt)."""
        for block_id in block_table:
            self._share(block_id)
        return list(block_table)

    def forget_uncomputed(self, block_table: list[int], num_computed: int) -> None:
        """Drop the prefix-cache names of the blocks past a sequence's first num_computed tokens.

        A block is named as soon as its tokens are known, when it is allocated, and its K/V is
        written in the same step's forward pass. When that step is aborted (an exception, a
        KeyboardInterrupt) the names would point a later prompt at rows never written; unnamed,
        the blocks are plain free blocks once released."""
        for block_id in block_table[num_computed // self.block_size :]:
            block = self.blocks[block_id]
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()

    def free_sequence(self, block_table: list[int]) -> None:
        for block_id in reversed(block_table):  # the tail is evicted before the shared head
            self.release(block_id)
        block_table.clear()

    def check_invariants(self, live_tables: list[list[int]]) -> None:
        """Every block's ref count equals the number of live tables holding it; free <=> 0."""
        counts = [0] * self.num_blocks
        for table in live_tables:
            for block_id in table:
                counts[block_id] += 1
        for block in self.blocks:
            if block.ref_count != counts[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id}: ref_count {block.ref_count}, held by {counts[block.block_id]} tables"
                )
            if (block.ref_count == 0) != (block.block_id in self.free):
                raise AssertionError(
                    f"block {block.block_id}: ref_count {block.ref_count} "
                    f"but {'in' if block.block_id in self.free else 'not in'} the free list"
                )


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """Flat slot index of token `position` of a sequence."""
    return block_table[position // block_size] * block_size + position % block_size


def kv_waste(sequence_lengths, block_size: int | None, max_len: int | None = None) -> float:
    """Fraction of reserved KV slots that hold no token.

    block_size=None: every request reserves max_len slots up front (contiguous preallocation).
    Otherwise a request holds ceil(len / block_size) blocks; only its last block is partly empty.
    """
    used = sum(sequence_lengths)
    if block_size is None:
        if max_len is None:
            raise ValueError("preallocation needs max_len")
        reserved = max_len * len(sequence_lengths)
    else:
        reserved = sum(blocks_needed(n, block_size) * block_size for n in sequence_lengths)
    return 1 - used / reserved


def copy_on_write_last_block(allocator: BlockAllocator, block_table: list[int]) -> bool:
    """Copy-on-write: before a sequence writes into the last block of its (non-empty) table.

    If that block is shared (ref_count > 1), take a free block (allocator.take_free_block()),
    drop this sequence's reference to the shared one (allocator.release(block_id)), record
    (shared block id, new block id) in allocator.copy_on_write_log so the KV store copies its
    rows, and put the new block's id at the end of block_table, in place. Returns True if it
    copied, False (and changes nothing) when the last block belongs to this sequence alone.
    """
    shared = block_table[-1]
    if allocator.blocks[shared].ref_count <= 1:
        return False
    copy = allocator.take_free_block()
    allocator.release(shared)
    allocator.copy_on_write_log.append((shared, copy.block_id))
    block_table[-1] = copy.block_id
    return True
