"""Lease timeline chart (PNG) for a chaos run, drawn with matplotlib's Agg canvas (headless).

One horizontal bar per lease from grant to end, coloured by outcome; heartbeats as ticks on the
bar; fault windows shaded across all bars; the reclaim bound marked per lease; the x axis in seconds
after the earliest grant. Built on a bare :class:`matplotlib.figure.Figure` with
``FigureCanvasAgg`` (no ``pyplot``: no global state, no display, safe in threads and CI).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.transforms import blended_transform_factory

from leasekit.telemetry import semconv as sc
from leasekit.telemetry.lease_timeline import LeaseTimeline

OUTCOME_COLORS = {
    sc.OUTCOME_RELEASED: "#2ca02c",
    sc.OUTCOME_EXPIRED: "#d62728",
    sc.OUTCOME_ABORTED: "#7f7f7f",
}
"""Bar colour per outcome; any other outcome (e.g. ``"open"`` from the stock-log reader) is drawn
as still open: :data:`OPEN_COLOR`, hatched, up to its ``end_s`` (the last instant observed)."""

OPEN_COLOR = "#1f77b4"
FAULT_COLOR = "#ffbf00"
BOUND_COLOR = "#000000"
LATE_READ_EVENT = "late_read"
"""Timeline event name drawn as a late read (``leasekit.telemetry.vllm_log.EVENT_LATE_READ``)."""

MAX_LABELLED_ROWS = 80
"""Above this many leases the y tick labels are dropped (unreadable); bars are still drawn."""

_ROW_IN = 0.28
_MAX_HEIGHT_IN = 60.0


@dataclass(frozen=True)
class PlotResult:
    """What :func:`plot_timeline` drew: the PNG path, the leases drawn and the malformed ones skipped."""

    path: Path
    leases_drawn: int
    skipped: int


def _finite(*values: float | None) -> bool:
    return all(v is not None and isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def _label(lease: LeaseTimeline, ranks: bool) -> str:
    rid = lease.request_id
    if len(rid) > 28:
        rid = rid[:12] + "\u2026" + rid[-12:]
    return f"{rid} tp{lease.tp_rank}" if ranks else rid


def plot_timeline(
    path_png: str | Path,
    leases: Sequence[LeaseTimeline],
    *,
    title: str,
    fault_windows: Iterable[tuple[float, float, str]] = (),
    bounds: Mapping[str, float] | None = None,
    clock_note: str = "",
    dpi: int = 100,
) -> PlotResult:
    """Draw the lease timeline of a run to a PNG.

    Args:
        path_png: the file to write (parent directories are created).
        leases: the leases, all on one clock (the lease's own: P's monotonic clock for spans, P's
            wall clock for stock logs). Drawn in grant order, first at the top. A lease whose grant
            or end is not a finite number, or that ends before its grant, is counted and skipped.
        title: the chart title.
        fault_windows: ``(start_s, end_s, label)`` on the same clock as the leases; shaded across all
            bars (``end_s <= start_s`` draws a line at ``start_s``). Malformed ones are skipped.
        bounds: ``request_id -> bound`` in seconds after that lease's grant (as
            ``LeaseVerdict.bound_s``), marked on every lease of that request; None for no marks.
        clock_note: which clock the times are on, appended to the x-axis label.
        dpi: resolution of the PNG.

    Returns:
        A :class:`PlotResult`. With no drawable lease the chart is empty with a note saying so.

    Raises:
        OSError: the file cannot be written.
    """
    drawable = [
        t for t in leases
        if isinstance(t, LeaseTimeline) and _finite(t.grant_s, t.end_s) and t.end_s >= t.grant_s
    ]
    skipped = len(leases) - len(drawable)
    drawable.sort(key=lambda t: (t.grant_s, t.request_id, t.tp_rank))
    windows = [
        (float(w[0]), float(w[1]), str(w[2]))
        for w in fault_windows
        if isinstance(w, (tuple, list)) and len(w) == 3 and _finite(w[0], w[1])
    ]
    origin = min((t.grant_s for t in drawable), default=min((w[0] for w in windows), default=0.0))
    ranks = len({t.tp_rank for t in drawable}) > 1

    n = len(drawable)
    height = min(_MAX_HEIGHT_IN, max(3.5, 1.9 + _ROW_IN * n))
    fig = Figure(figsize=(11, height), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title, pad=16 if windows else 6)
    xlabel = "seconds after the earliest grant"
    ax.set_xlabel(f"{xlabel} ({clock_note})" if clock_note else xlabel)

    legend: dict[str, object] = {}
    bar_h = 0.6
    for y, lease in enumerate(drawable):
        start, width = lease.grant_s - origin, lease.end_s - lease.grant_s
        color = OUTCOME_COLORS.get(lease.outcome)
        if color is None:
            ax.barh(y, width, left=start, height=bar_h, color=OPEN_COLOR, alpha=0.35, hatch="//",
                    edgecolor=OPEN_COLOR, linewidth=0.8)
            legend.setdefault("still open", Patch(facecolor=OPEN_COLOR, alpha=0.35, hatch="//", edgecolor=OPEN_COLOR))
        else:
            ax.barh(y, width, left=start, height=bar_h, color=color, alpha=0.85)
            legend.setdefault(lease.outcome, Patch(facecolor=color, alpha=0.85))
        hbs = [h - origin for h in lease.heartbeats_s if _finite(h)]
        if hbs:
            ax.plot(hbs, [y] * len(hbs), linestyle="none", marker="|", markersize=11, markeredgewidth=1.6, color="#111111")
            legend.setdefault("heartbeat", Line2D([], [], linestyle="none", marker="|", markersize=11,
                                                   markeredgewidth=1.6, color="#111111"))
        late = [t - origin for name, t in lease.events if name == LATE_READ_EVENT and _finite(t)]
        if late:
            ax.plot(late, [y] * len(late), linestyle="none", marker="x", markersize=8, markeredgewidth=2, color="#9400d3")
            legend.setdefault("late read", Line2D([], [], linestyle="none", marker="x", markersize=8,
                                                   markeredgewidth=2, color="#9400d3"))
        bound = None if bounds is None else bounds.get(lease.request_id)
        if _finite(bound):
            x = lease.grant_s - origin + float(bound)
            ax.plot([x, x], [y - 0.45, y + 0.45], color=BOUND_COLOR, linewidth=2.2, solid_capstyle="butt")
            ax.plot([x], [y - 0.45], linestyle="none", marker="v", markersize=5, color=BOUND_COLOR)
            legend.setdefault("reclaim bound", Line2D([], [], color=BOUND_COLOR, linewidth=2.2, marker="v", markersize=5))

    label_at = blended_transform_factory(ax.transData, ax.transAxes)
    for start, end, label in windows:
        s, e = start - origin, end - origin
        if e > s:
            ax.axvspan(s, e, color=FAULT_COLOR, alpha=0.25, zorder=0, linewidth=0)
            legend.setdefault("fault window", Patch(facecolor=FAULT_COLOR, alpha=0.25))
        else:
            ax.axvline(s, color=FAULT_COLOR, linewidth=2, zorder=0)
            legend.setdefault("fault instant", Line2D([], [], color=FAULT_COLOR, linewidth=2))
        ax.text(s, 1.0, f" {label}", transform=label_at, va="bottom", ha="left", fontsize=8, color="#805f00", clip_on=False)

    if n:
        ax.set_ylim(n - 0.5, -0.5)  # first grant on top
        if n <= MAX_LABELLED_ROWS:
            ax.set_yticks(range(n), [_label(t, ranks) for t in drawable], fontsize=8 if n > 20 else 9)
        else:
            ax.set_yticks([])
            ax.set_ylabel(f"{n} leases")
    else:
        ax.set_yticks([])
        ax.text(0.5, 0.5, "no leases observed", transform=ax.transAxes, ha="center", va="center", fontsize=13, color="#555555")
        if not windows:
            ax.set_xlim(0, 1)
    if skipped:
        ax.text(1.0, -0.02, f"{skipped} malformed lease(s) skipped", transform=ax.transAxes,
                ha="right", va="top", fontsize=8, color="#d62728")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    if legend:
        order = [k for k in (sc.OUTCOME_RELEASED, sc.OUTCOME_EXPIRED, sc.OUTCOME_ABORTED, "still open",
                             "heartbeat", "late read", "reclaim bound", "fault window", "fault instant") if k in legend]
        fig.legend([legend[k] for k in order], order, loc="outside lower center", ncols=min(len(order), 9),
                   fontsize=9, frameon=False)

    out = Path(path_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return PlotResult(out, n, skipped)
