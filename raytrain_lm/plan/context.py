"""Context parallelism in the planner: which degrees a structure is planned with (its memory,
compute and traffic: memory.py, kernels.py, comm.py). No torch."""

from __future__ import annotations

from typing import Optional

CP_FROM_SEQ = 8192  # the planner tries context parallelism from this window length


def cp_sizes(structure: tuple, seq_len: int, ep: int, cp: Optional[int] = None) -> list[int]:
    """The context-parallel degrees worth planning for a structure: 1, and for windows of
    CP_FROM_SEQ tokens or more (below, a sequence's activations fit one GPU with tp and
    checkpointing; cp only adds traffic) every power of two that divides its data-parallel ranks
    and splits the window into 2cp chunks, where train runs it (Layout.problems: no ep);
    `cp`: that one alone."""
    t, p, dp, kind, ac, sp, schedule, v = structure
    if cp is not None:
        return [cp] if dp % cp == 0 and seq_len % (2 * cp) == 0 and (cp == 1 or ep == 1) else []
    if seq_len < CP_FROM_SEQ or ep > 1:
        return [1]
    return [c for c in (1, 2, 4, 8, 16, 32) if dp % c == 0 and seq_len % (2 * c) == 0]
