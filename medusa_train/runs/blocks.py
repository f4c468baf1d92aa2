"""World-size-independent work blocks: conversations ``[b * size, (b + 1) * size)`` form block ``b``.

The hidden-state cache (:mod:`medusa_train.training.hidden_cache`) and self-distillation
(:mod:`medusa_train.data.self_distill`) split their work the same way: into blocks of a fixed number of
conversations (never derived from the world size), each written to its own file named by its block index, and
dealt to ranks round-robin (block ``b`` to rank ``b % world_size``). A run resumed on another number of ranks finds
every finished block under the same name and redoes none of them.
"""

from __future__ import annotations


def check_rank(rank: int, world_size: int) -> None:
    """Raises:
        ValueError: ``world_size`` not positive or ``rank`` outside ``[0, world_size)``."""
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank} world_size={world_size}")


def check_block_size(block_size: int, key: str = "block_size") -> None:
    """Raises:
        ValueError: ``block_size`` (named ``key``) is not a positive integer."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"{key} must be a positive number of conversations, got {block_size!r}")


def block_count(n: int, block_size: int) -> int:
    """How many blocks ``n`` conversations make (the last one may be short; 0 for none)."""
    return -(-n // block_size)


def block_rows(block: int, n: int, block_size: int) -> range:
    """The conversation indices of ``block`` among ``n``."""
    return range(block * block_size, min((block + 1) * block_size, n))


def rank_blocks(n: int, block_size: int, rank: int, world_size: int) -> range:
    """The blocks rank ``rank`` of ``world_size`` builds: ``rank, rank + world_size, ...``.

    Raises:
        ValueError: a bad ``rank``/``world_size`` or ``block_size``.
    """
    check_rank(rank, world_size)
    check_block_size(block_size)
    return range(rank, block_count(n, block_size), world_size)


__all__ = ["block_count", "block_rows", "check_block_size", "check_rank", "rank_blocks"]
