"""Which P ranks a D rank talks to, and how many D ranks each P rank waits for (no DCP).

Source: vllm 0.32.0 ``kv_connector/utils.py`` ``TransferTopology.tp_ratio``,
``handshake_target_ranks`` (D handshakes with, reads from and heartbeats exactly these P ranks:
``base_worker.py _send_heartbeats`` sends to every agent of ``_remote_agents[engine]``) and
``dcp_consumer_count`` (the ``n`` in each ``"{req_id}:{n}"`` completion).
"""

from __future__ import annotations


def _check(d_tp: int, p_tp: int) -> None:
    for name, value in (("decode tp_size", d_tp), ("prefill tp_size", p_tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if max(d_tp, p_tp) % min(d_tp, p_tp):
        raise ValueError(f"tp sizes must divide one another (vLLM asserts it): decode {d_tp}, prefill {p_tp}")


def prefill_ranks_for(d_rank: int, d_tp: int, p_tp: int) -> tuple[int, ...]:
    """The P ranks D rank ``d_rank`` handshakes with, reads from and sends heartbeats to.

    ``D_tp >= P_tp``: one P rank, ``d_rank // (D_tp / P_tp)``. ``D_tp < P_tp``: ``P_tp / D_tp``
    consecutive P ranks starting at ``d_rank * (P_tp / D_tp)``.

    Raises:
        ValueError: sizes not positive integers dividing one another, or ``d_rank`` out of range.
    """
    _check(d_tp, p_tp)
    if not 0 <= d_rank < d_tp:
        raise ValueError(f"d_rank must be in [0, {d_tp}), got {d_rank}")
    if d_tp >= p_tp:
        return (d_rank // (d_tp // p_tp),)
    k = p_tp // d_tp
    return tuple(d_rank * k + i for i in range(k))


def consumers_per_prefill_rank(d_tp: int, p_tp: int) -> int:
    """How many D ranks read from (and send a completion to) each P rank: ``max(1, D_tp / P_tp)``.

    Raises:
        ValueError: as :func:`prefill_ranks_for`.
    """
    _check(d_tp, p_tp)
    return max(1, d_tp // p_tp)


def decode_ranks_for(p_rank: int, d_tp: int, p_tp: int) -> tuple[int, ...]:
    """The D ranks that talk to P rank ``p_rank`` (inverse of :func:`prefill_ranks_for`)."""
    _check(d_tp, p_tp)
    if not 0 <= p_rank < p_tp:
        raise ValueError(f"p_rank must be in [0, {p_tp}), got {p_rank}")
    return tuple(d for d in range(d_tp) if p_rank in prefill_ranks_for(d, d_tp, p_tp))
