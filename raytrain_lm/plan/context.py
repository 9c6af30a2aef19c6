"""Context parallelism in the planner: which degrees a structure is planned with (its memory,
compute and traffic: memory.py, kernels.py, comm.py). No torch."""

from __future__ import annotations

from typing import Optional

CP_FROM_SEQ = 8192  # the planner tries context parallelism from this window length


def cp_sizes(structure: tuple, seq_len: int, ep: int, cp: Optional[int] = None) -> list[int]:
    """The context-parallel degrees worth planning for a structure: 1, and for windows of
    CP_FROM_SEQ tokens or more (below, a sequence's activations fit one GPU with tp and
    checkpointing; cp only adds traffic) every power of two that divides its data-parallel ranks
    and splits the window into 2cp chunks, leaving the ep ranks (ep divides dp / cp, as
    Layout.problems asks); `cp`: that one alone."""
    t, p, dp, kind, ac, sp, schedule, v = structure
    fits = [c for c in ((cp,) if cp is not None else (1, 2, 4, 8, 16, 32))
            if dp % c == 0 and (dp // c) % ep == 0 and seq_len % (2 * c) == 0]
    if cp is None and seq_len < CP_FROM_SEQ:
        return [1]
    return fits
