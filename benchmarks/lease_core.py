"""Lease bookkeeping cost: leasekit's ``PLeaseTable`` against vLLM 0.32.0's NIXL P-side algorithm.

For N = 1k, 10k and 100k live leases, in one process, it times (median µs per operation):
``grant`` (one lease into a table holding N); ``heartbeat_1k`` (one heartbeat batch naming 1k live ids,
the ``a,b,...`` payload split by both sides); ``reap_none_expired`` (one reap, nothing expired); and
``step``, all lease bookkeeping of one engine step: one grant, then decoding and handling two raw NIXL
notifications (a heartbeat naming 16 live ids, a completion that releases a lease), then a reap with
nothing expired (leasekit: ``grant`` + ``decode_notification`` + ``PLeaseTable.step``; vLLM:
``start_load_kv``'s insert + ``_get_new_notifs`` + ``_reap_expired_send_leases``).

Baseline ``vllm`` (default) calls vLLM's own ``_handle_heartbeat``, ``_get_new_notifs`` and
``_reap_expired_send_leases`` on ``object.__new__(NixlPullConnectorWorker)`` given the attributes they
read, ``base_worker.time.perf_counter`` replaced by a fake clock; its grant is ``start_load_kv``'s two
inserts. Baseline ``reimpl`` (also the fallback if vLLM does not import) re-implements that dict
algorithm. Timing: ``time.perf_counter_ns`` around batches of calls, gc off (as timeit), leasekit and
baseline alternating, each timed batch after an untimed warm-up batch; median over repetitions.
Goals: reap at 100k >= 50x faster than vLLM's full scan; step at 10k < 100 µs for leasekit.

Run: ``.venv/bin/python benchmarks/lease_core.py [--quick] [--json PATH] [--baseline vllm|reimpl]``
(exit code 0 whether or not a goal is met; non-zero only on a crash).
"""

from __future__ import annotations

import argparse, gc, json, random, statistics, sys, time
from collections import defaultdict, deque
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from leasekit.lease.codec import decode_notification  # noqa: E402
from leasekit.lease.config import LeaseTiming  # noqa: E402
from leasekit.lease.table import PLeaseTable  # noqa: E402

TIMING = LeaseTiming.from_lease_duration(30)  # L = 30 s (vLLM's default kv_lease_duration), E = 20 s
CLOCK = [0.0]  # the fake perf_counter of the baseline (seconds); leasekit is passed the same value
AGENT = "d-agent-0"
STEP_DEF = "step = 1 grant + decode & handle 1 heartbeat (16 ids) + 1 releasing completion + 1 reap (none expired)"


def init_state(w):
    """Give ``w`` the (empty) attributes that vLLM's lease methods read; ``notifs``: this step's NIXL messages."""
    w._reqs_to_send, w._reqs_to_process, w.notifs, w._lease_extension = {}, set(), [], TIMING.extension_s
    w.consumer_notification_counts_by_req, w.expected_consumer_notifications_by_req = defaultdict(int), {}
    return w


class ReimplWorker:
    """vLLM 0.32.0's P-side lease bookkeeping (base_worker/pull_worker), re-implemented without logging."""

    def __init__(self):
        init_state(self)

    def _handle_heartbeat(self, payload):
        """For each id in the payload: ``expiry = max(old, now + E)``."""
        new_expiry = CLOCK[0] + self._lease_extension
        for req_id in payload.split(","):
            if req_id in self._reqs_to_send:
                self._reqs_to_send[req_id] = max(self._reqs_to_send[req_id], new_expiry)

    def _get_new_notifs(self):
        """Decode heartbeats and completions; count completions and release at the expected count."""
        done, counts = set(), self.consumer_notification_counts_by_req
        expected = self.expected_consumer_notifications_by_req
        for notif in self.notifs:
            msg = notif.decode("utf-8")
            if msg.startswith("HB:"):
                self._handle_heartbeat(msg[3:])
                continue
            req_id, n = msg.rsplit(":", 1)
            if req_id not in self._reqs_to_send and req_id not in self._reqs_to_process:
                continue
            expected[req_id] = int(n)
            counts[req_id] += 1
            if counts[req_id] == expected[req_id]:
                done.add(req_id)
                del counts[req_id], expected[req_id]
                self._reqs_to_process.remove(req_id)
                self._reqs_to_send.pop(req_id, None)
        return done

    def _reap_expired_send_leases(self, done_sending):
        """Full scan of every lease: those with ``now >= expires`` end."""
        if not self._reqs_to_send:
            return
        now = CLOCK[0]
        for req_id in [r for r, expires in self._reqs_to_send.items() if now >= expires]:
            self.consumer_notification_counts_by_req.pop(req_id, 0)
            self.expected_consumer_notifications_by_req.pop(req_id, None)
            self._reqs_to_process.remove(req_id)
            del self._reqs_to_send[req_id]
            done_sending.add(req_id)


def make_baseline(kind):
    """(factory of empty baseline workers, description of the baseline)."""
    if kind == "vllm":
        try:
            import vllm
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
        except Exception as exc:  # noqa: BLE001 - fall back, and say so
            print(f"vLLM import failed ({exc!r}); falling back to the re-implementation", file=sys.stderr)
            kind = "reimpl"
    if kind == "reimpl":
        return ReimplWorker, "reimpl (vLLM 0.32.0's dict algorithm re-implemented here, no logging calls)"
    base_worker.time = SimpleNamespace(perf_counter=lambda: CLOCK[0])  # this module's clock only

    def new():
        w = init_state(object.__new__(NixlPullConnectorWorker))
        w.xfer_stats, w.transfer_topo = NixlKVConnectorStats(), object()
        w.nixl_wrapper = SimpleNamespace(get_new_notifs=lambda: {AGENT: w.notifs})
        return w

    return new, f"vllm {vllm.__version__}: its own methods on object.__new__(NixlPullConnectorWorker), fake clock"


def timed(lk_batch, vl_batch, reps, kmax=1000, target_ns=300_000):
    """[(median, mean) µs per op] of leasekit's and the baseline's ``batch(k) -> ns``, run alternately.

    k (ops per batch) is calibrated per side so that a batch takes about ``target_ns``, at most ``kmax``;
    each timed batch follows an untimed one (warm caches, as in a timeit loop).
    """
    gc.disable()
    try:
        ks = [max(1, min(kmax, int(target_ns / max(b(1), 1)))) for b in (lk_batch, vl_batch)]
        per_op = [[], []]
        for _ in range(reps):
            for i, b in enumerate((lk_batch, vl_batch)):
                b(ks[i])  # warm-up: the other side just evicted this one from the caches
                per_op[i].append(b(ks[i]) / ks[i] / 1000)
    finally:
        gc.enable()
    return [(statistics.median(p), statistics.fmean(p)) for p in per_op]


def bench_size(n, new_worker, reps):
    """The four operations at ``n`` live leases: {op: [(leasekit median, mean), (vLLM median, mean)]}."""
    CLOCK[0], L = 0.0, TIMING.lease_duration_s
    ids = [f"req-{n}-{i:07d}" for i in range(n)]
    pinned = ids[: min(1024, n // 2)]  # heartbeated by steps, never completed
    churns = [deque(ids[len(pinned):]) for _ in range(2)]  # per side: completed oldest first by steps
    table, w = PLeaseTable(TIMING), new_worker()
    for i, rid in enumerate(ids):  # granted over the last L/2: deadlines spread over [L/2, L]
        t = -L / 2 * (1 - i / n)
        table.grant(rid, t)
        w._reqs_to_process.add(rid)
        w._reqs_to_send[rid] = t + L
    rng, fresh = random.Random(n), iter(range(10**9))
    payloads = [",".join(rng.sample(ids, 1000)) for _ in range(16)]

    def repeat(run, dt, arg=lambda: None, undo=None):
        """batch(k): k timed calls ``run(arg(), now)``, the clock advancing ``dt`` s each; then ``undo``."""
        def batch(k):
            calls = [(arg(), CLOCK[0] + dt * (j + 1)) for j in range(k)]
            t0 = time.perf_counter_ns()
            for a, CLOCK[0] in calls:  # the baseline reads CLOCK; leasekit is passed it
                run(a, CLOCK[0])
            t1 = time.perf_counter_ns()
            for a, now in calls if undo else ():
                undo(a, now)
            return t1 - t0
        return batch

    def plan(churn):
        """arg() of one step: (a new id, [heartbeat naming 16 pinned ids, completion releasing one lease])."""
        def make():
            done, new = churn.popleft(), f"s-{next(fresh)}"
            churn.append(new)
            return new, [("HB:" + ",".join(rng.sample(pinned, 16))).encode(), f"{done}:1".encode()]
        return make

    def lk_step(p, now):
        table.grant(p[0], now)
        table.step(now, [(AGENT, decode_notification(m)) for m in p[1]])

    def vl_grant(rid, now):  # pull_worker.start_load_kv
        w._reqs_to_process.add(rid)
        w._reqs_to_send[rid] = now + L

    def vl_step(p, now):
        vl_grant(p[0], now)
        w.notifs = p[1]
        w._reap_expired_send_leases(w._get_new_notifs())  # get_transfer_results' lease bookkeeping

    def vl_ungrant(rid, now):
        w._reqs_to_process.remove(rid)
        del w._reqs_to_send[rid]

    new_id, payload = (lambda: f"g-{next(fresh)}"), (lambda: rng.choice(payloads))
    out = {
        "grant": timed(repeat(table.grant, 1e-5, new_id, table.release),
                       repeat(vl_grant, 1e-5, new_id, vl_ungrant), reps, kmax=n // 10),
        "heartbeat_1k": timed(repeat(lambda p, now: table.heartbeat(p.split(","), now), 1e-3, payload),
                              repeat(lambda p, now: w._handle_heartbeat(p), 1e-3, payload), reps),
        "reap_none_expired": timed(repeat(lambda _, now: table.reap(now), 1e-6),
                                   repeat(lambda _, now: w._reap_expired_send_leases(set()), 1e-6), reps),
        "step": timed(repeat(lk_step, 1e-4, plan(churns[0])), repeat(vl_step, 1e-4, plan(churns[1])), reps),
    }
    assert CLOCK[0] < L / 2, "the clock reached the first deadline: something expired"
    assert len(table) == len(w._reqs_to_send) == n, (len(table), len(w._reqs_to_send), n)  # steps released
    return out


def main(argv=None):
    """Run every size, print the table and the goals, write JSON if asked; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5 repetitions instead of 31: a smoke run")
    ap.add_argument("--json", metavar="PATH", help="also write the results (with means) as JSON")
    ap.add_argument("--baseline", choices=["vllm", "reimpl"], default="vllm")
    args = ap.parse_args(argv)
    reps = 5 if args.quick else 31
    new_worker, baseline = make_baseline(args.baseline)
    rows = []
    for n in (1_000, 10_000, 100_000):
        for op, ((lk, lk_mean), (vl, vl_mean)) in bench_size(n, new_worker, reps).items():
            rows.append(dict(op=op, n=n, leasekit_us=lk, vllm_us=vl, ratio=vl / lk,
                             leasekit_mean_us=lk_mean, vllm_mean_us=vl_mean))
    print(f"baseline: {baseline}\nrepetitions: {reps}; median µs per operation; ratio = vLLM / leasekit\n{STEP_DEF}")
    print(f"{'operation':<18} {'N':>7} {'leasekit µs':>12} {'vLLM µs':>10} {'ratio':>9}")
    for r in rows:
        print(f"{r['op']:<18} {r['n']:>7} {r['leasekit_us']:>12.2f} {r['vllm_us']:>10.2f} {r['ratio']:>8.1f}x")
    get = {(r["op"], r["n"]): r for r in rows}
    reap, step = get["reap_none_expired", 100_000], get["step", 10_000]
    goals = [("reap, nothing expired, N=100k: >= 50x faster than vLLM", reap["ratio"] >= 50,
              f"{reap['ratio']:.0f}x ({reap['leasekit_us']:.2f} µs vs {reap['vllm_us']:.0f} µs)"),
             ("all bookkeeping of one step, N=10k: < 100 µs (leasekit)", step["leasekit_us"] < 100,
              f"{step['leasekit_us']:.2f} µs (vLLM {step['vllm_us']:.2f} µs)")]
    goals = [dict(goal=g, ok=ok, measured=m) for g, ok, m in goals]
    for i, g in enumerate(goals, 1):
        print(f"goal {i}: {'PASS' if g['ok'] else 'MISS'}  {g['goal']}: {g['measured']}")
    if args.json:
        doc = dict(baseline=baseline, repetitions=reps, step_definition=STEP_DEF, rows=rows, goals=goals)
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
