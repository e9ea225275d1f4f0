"""A second NIXL peer of a real P: does the side-channel handshake as a D worker would, then sends
whatever notifications a test asks for (forged heartbeats and completions, fuzz), or raw side-channel
requests (malformed handshakes).

It is a real NIXL agent (UCX, the same ``nixl`` package vLLM uses) and speaks vLLM 0.32.0's side
channel exactly as D does (``nixl/base_worker.py: _nixl_handshake``): a ZMQ ``REQ`` socket sends
``msgpack((GET_META_MSG, pp_rank, tp_rank))``; P's listener (``nixl/base_scheduler.py:
_nixl_handshake_listener``) answers ``[NixlHandshakePayload, msgpack(perf_counter)]``. The peer skips
D's compatibility and layout checks: it never reads KV, it only needs P's agent metadata to send
notifications.
"""

from __future__ import annotations

import uuid

import msgspec
import zmq

GET_META_MSG = b"get_meta_msg"
"""vLLM's handshake request tag (``nixl/metadata.py: GET_META_MSG``)."""


class HandshakeError(RuntimeError):
    """The side channel did not answer a well-formed handshake in time, or answered garbage."""


def side_channel_request(host: str, port: int, payload: bytes, *, timeout_s: float = 5.0) -> list[bytes] | None:
    """Send one raw request to P's side channel; return the reply frames, or None on no reply.

    Args:
        host, port: P's ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT`` (the TP-rank-0 listener).
        payload: the request bytes, sent as one frame (a well-formed one is
            ``msgspec.msgpack.encode((GET_META_MSG, pp_rank, tp_rank))``).
        timeout_s: how long to wait for the reply, in seconds.
    """
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(payload)
        return sock.recv_multipart()
    except zmq.Again:
        return None
    finally:
        sock.close(linger=0)


def handshake_request(pp_rank: int = 0, tp_rank: int = 0) -> bytes:
    """The well-formed handshake request D sends for ``(pp_rank, tp_rank)``."""
    return msgspec.msgpack.encode((GET_META_MSG, pp_rank, tp_rank))


class NixlPeer:
    """A NIXL agent that handshakes with P and sends it notifications.

    Use as a context manager. ``handshake()`` returns P's agent name for ``send()``.

    Raises:
        ImportError: the ``nixl`` package is not installed.
    """

    def __init__(self, name: str | None = None):
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name or f"leasekit-peer-{uuid.uuid4()}"
        self.agent = nixl_agent(self.name, nixl_agent_config(num_threads=1))
        self.remotes: list[str] = []

    def handshake(self, host: str, port: int, *, pp_rank: int = 0, tp_rank: int = 0, timeout_s: float = 5.0) -> str:
        """Fetch P's NIXL agent metadata over the side channel and load it; returns P's agent name.

        Raises:
            HandshakeError: no reply within ``timeout_s`` seconds, or a reply that does not decode.
        """
        reply = side_channel_request(host, port, handshake_request(pp_rank, tp_rank), timeout_s=timeout_s)
        if reply is None:
            raise HandshakeError(f"no handshake reply from {host}:{port} within {timeout_s} s")
        try:
            payload = msgspec.msgpack.decode(reply[0])  # NixlHandshakePayload, array- or map-encoded
            agent_bytes = payload["agent_metadata_bytes"] if isinstance(payload, dict) else payload[1]
            agent_meta = msgspec.msgpack.decode(agent_bytes)
            metadata = agent_meta["agent_metadata"] if isinstance(agent_meta, dict) else agent_meta[1]
        except (msgspec.DecodeError, KeyError, IndexError, TypeError) as exc:
            raise HandshakeError(f"undecodable handshake reply from {host}:{port}: {exc}") from exc
        remote = self.agent.add_remote_agent(metadata)
        name = remote.decode() if isinstance(remote, bytes) else str(remote)
        self.remotes.append(name)
        return name

    def send(self, remote: str, message: bytes) -> None:
        """Send one NIXL notification (raw bytes) to ``remote``; NIXL errors propagate."""
        self.agent.send_notif(remote, notif_msg=message)

    def close(self) -> None:
        """Unload every remote agent (errors ignored)."""
        for remote in self.remotes:
            try:
                self.agent.remove_remote_agent(remote)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self.remotes.clear()

    def __enter__(self) -> "NixlPeer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
