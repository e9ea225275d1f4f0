"""Connector-level fault points of LeaseKitConnector, driven by a control file.

The chaos runner writes JSON to the file named by env ``LEASEKIT_FAULT_FILE`` (set per server at
launch); each worker checks the file's mtime once per engine step (one ``os.stat``) and applies:

- ``forward_stall_s``: sleep that long inside the next forward pass (``start_load_kv``), once per
  control ``seq`` — one forward pass takes N seconds, delaying heartbeats and notifications;
- ``writer_stall_s`` (push mode, P): vLLM's ``nixl-push-writer`` thread sleeps that long right before it
  submits the next WRITE (``_xfer_blocks_for_req``), once per control ``seq``: the writer thread, which alone
  drains P's NIXL notifications in push mode, hears nothing meanwhile;
- ``heartbeats``: ``{"drop_next": k}`` drops the next k heartbeat batches in a row,
  ``{"drop_fraction": f}`` drops each batch with probability f, ``{"delay_s": x}`` sends each batch
  x seconds late (on the first step after that), ``{"duplicate": n}`` sends each batch n times,
  ``{"delay_next_s": y}`` (with ``drop_next``) sends the first batch after the drops y seconds late.

What was applied is written back, atomically, to ``<control file>.tp<rank>.state.json`` together
with clock probes (``perf_counter``, ``time.time``) so a test can prove a fault took effect. With
no control file configured, every hook is a no-op costing one attribute check.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

FAULT_FILE_ENV = "LEASEKIT_FAULT_FILE"


def state_path(control_path: str, tp_rank: int) -> str:
    """Where the worker of ``tp_rank`` reports what it applied."""
    return f"{control_path}.tp{tp_rank}.state.json"


def write_control(path: str, control: dict) -> int:
    """Atomically replace the control file with ``control``; returns its ``seq`` (a fresh one is
    added if missing). The worker's state restarts from zero for every new ``seq``."""
    control = dict(control)
    control.setdefault("seq", time.monotonic_ns())
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".control-")
    with os.fdopen(fd, "w") as handle:
        json.dump(control, handle)
    os.replace(tmp, path)
    return control["seq"]


def read_state(path: str, tp_rank: int = 0) -> dict | None:
    """The worker's last reported state, or None if it has reported nothing (yet)."""
    try:
        with open(state_path(path, tp_rank)) as handle:
            return json.load(handle)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _fresh_state(errors: int = 0) -> dict:
    return {"heartbeat_batches_seen": 0, "dropped": [], "delayed": 0, "duplicated": 0, "stalls": [], "writer_stalls": [],
            "errors": errors}


@dataclass
class FaultPoints:
    """Per-worker fault state. ``path`` None disables everything."""

    path: str | None
    tp_rank: int = 0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    _mtime: float = -1.0
    control: dict = field(default_factory=dict)
    seq: Any = None
    stall_done_seq: Any = None
    writer_stall_done_seq: Any = None
    writer_plan: tuple = (None, 0.0)  # (seq, writer_stall_s) of the loaded control, for the writer thread
    drop_left: int = 0
    delay_next_left: float = 0.0
    delayed: list = field(default_factory=list)  # (due perf_counter, heartbeat_by_engine)
    state: dict = field(default_factory=lambda: _fresh_state())

    @classmethod
    def from_env(cls, tp_rank: int) -> "FaultPoints":
        """Fault points for this worker, enabled iff ``LEASEKIT_FAULT_FILE`` is set."""
        return cls(os.environ.get(FAULT_FILE_ENV) or None, tp_rank)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def poll(self) -> None:
        """Reload the control file if it changed (one stat per step)."""
        if self.path is None:
            return
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            with open(self.path) as handle:
                control = json.load(handle)
        except (OSError, json.JSONDecodeError):
            self.state["errors"] += 1
            return
        if not isinstance(control, dict):
            self.state["errors"] += 1
            return
        self.control = control
        try:
            self.writer_plan = (control.get("seq"), max(0.0, float(control.get("writer_stall_s") or 0.0)))
        except (TypeError, ValueError):
            self.state["errors"] += 1
            self.writer_plan = (control.get("seq"), 0.0)
        if control.get("seq") != self.seq:
            self.seq = control.get("seq")
            self.state = _fresh_state(errors=self.state["errors"])
            hb = control.get("heartbeats") or {}
            self.drop_left = int(hb.get("drop_next", 0) or 0)
            self.delay_next_left = float(hb.get("delay_next_s", 0) or 0.0)
        self.write_state()

    def heartbeats_disturbed(self) -> bool:
        """Whether a heartbeat fault is set (drops, delays or duplicates pending or configured): D's read
        probe, a heartbeat too, is then not sent, so the fault reaches every heartbeat path."""
        hb = self.control.get("heartbeats") or {}
        return bool(self.drop_left > 0 or self.delay_next_left > 0 or hb.get("drop_fraction")
                    or hb.get("delay_s") or int(hb.get("duplicate") or 1) > 1)

    def forward_stall(self) -> float:
        """Seconds to stall this forward pass (once per control seq); 0.0 if none."""
        stall = float(self.control.get("forward_stall_s") or 0.0)
        if stall <= 0 or self.stall_done_seq == self.seq:
            return 0.0
        self.stall_done_seq = self.seq
        return stall

    def writer_stall(self) -> float:
        """Seconds P's push writer thread should sleep before its next WRITE (once per control seq); 0.0 if none.
        Called on the writer thread: reads the control the engine thread's :meth:`poll` loaded."""
        seq, stall = self.writer_plan  # one tuple, replaced whole by poll(): never a control and a seq of two reads
        if stall <= 0 or self.writer_stall_done_seq == seq:
            return 0.0
        self.writer_stall_done_seq = seq
        return stall

    def record_writer_stall(self, start: float, end: float) -> None:
        """Report a push writer stall that ran from ``start`` to ``end`` (perf_counter seconds)."""
        self.state.setdefault("writer_stalls", []).append({"start_perf_s": start, "end_perf_s": end,
                                                           "seconds": end - start})
        self.write_state()

    def record_stall(self, start: float, end: float) -> None:
        """Report a forward-pass stall that ran from ``start`` to ``end`` (perf_counter seconds)."""
        self.state["stalls"].append({"start_perf_s": start, "end_perf_s": end, "seconds": end - start})
        self.write_state()

    def heartbeat_action(self) -> tuple[str, int, float]:
        """What to do with a due heartbeat batch: ``("send", copies, 0)``, ``("drop", 0, 0)`` or
        ``("delay", 0, seconds)``."""
        self.state["heartbeat_batches_seen"] += 1
        hb = self.control.get("heartbeats") or {}
        if self.drop_left > 0:
            self.drop_left -= 1
            return "drop", 0, 0.0
        if self.delay_next_left > 0:
            delay, self.delay_next_left = self.delay_next_left, 0.0
            return "delay", 0, delay
        fraction = float(hb.get("drop_fraction") or 0.0)
        if fraction and self.rng.random() < fraction:
            return "drop", 0, 0.0
        delay = float(hb.get("delay_s") or 0.0)
        if delay > 0:
            return "delay", 0, delay
        return "send", max(1, int(hb.get("duplicate") or 1)), 0.0

    def record_heartbeat(self, action: str, ids: list[str], copies: int = 1) -> None:
        """Report what happened to one batch (``ids``: P request ids it named)."""
        now = time.perf_counter()
        if action == "drop":
            self.state["dropped"].append({"perf_s": now, "wall_s": time.time(), "req_ids": ids})
        elif action == "delay":
            self.state["delayed"] += 1
        elif copies > 1:
            self.state["duplicated"] += copies - 1
        if action != "send" or copies > 1:
            self.write_state()

    def write_state(self) -> None:
        """Atomically write the state file with fresh clock probes; never raises."""
        if self.path is None:
            return
        state = dict(self.state, seq=self.seq, perf_counter=time.perf_counter(), time=time.time(), pid=os.getpid())
        try:
            target = state_path(self.path, self.tp_rank)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(target)), prefix=".state-")
            with os.fdopen(fd, "w") as handle:
                json.dump(state, handle)
            os.replace(tmp, target)
        except OSError:
            self.state["errors"] += 1
