"""A KV block pool with generation counters: every allocation bumps the block's generation, so a
reader holding ``(block, generation)`` detects that its blocks were freed or reused."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class BlockRef:
    """A block id and the generation it had when it was handed out."""

    block: int
    generation: int


@dataclass
class BlockPool:
    """``num_blocks`` blocks of one P rank. Free blocks are reused lowest-id first (LIFO would hide
    reuse less well). Double frees are counted in ``violations`` rather than raised, so a checker can
    report them."""

    num_blocks: int
    _generation: list[int] = field(init=False)
    _free: list[int] = field(init=False)
    _owner: dict[int, str] = field(default_factory=dict)
    violations: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        self._generation = [0] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))

    @property
    def pinned(self) -> int:
        """Blocks currently allocated."""
        return self.num_blocks - len(self._free)

    def allocate(self, owner: str, n: int) -> list[BlockRef] | None:
        """Allocate ``n`` blocks to ``owner``; None if the pool is short (the caller must wait)."""
        if n > len(self._free):
            return None
        refs = []
        for _ in range(n):
            block = self._free.pop()
            self._generation[block] += 1
            self._owner[block] = owner
            refs.append(BlockRef(block, self._generation[block]))
        return refs

    def free(self, owner: str, refs: list[BlockRef]) -> int:
        """Free ``owner``'s blocks; a block not held by ``owner`` at that generation is a double
        free (counted). Returns how many blocks were actually freed."""
        freed = 0
        for ref in refs:
            if self._owner.get(ref.block) != owner or self._generation[ref.block] != ref.generation:
                self.violations["double_free"] += 1
                continue
            del self._owner[ref.block]
            self._free.append(ref.block)
            freed += 1
        self._free.sort(reverse=True)
        return freed

    def read(self, owner: str, refs: list[BlockRef]) -> str:
        """What a remote read of ``refs`` (taken for ``owner``) would see: ``ok``, ``freed`` (not
        reallocated since) or ``reused`` (reallocated: another request's KV)."""
        result = "ok"
        for ref in refs:
            if self._generation[ref.block] != ref.generation:
                return "reused"
            if self._owner.get(ref.block) != owner:
                result = "freed"
        return result
