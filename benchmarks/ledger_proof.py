"""The ledger proof's cost and speed on the CPU testbed (real SGLang TP=2): proof latency, throughput with the
ledger on vs off, false verdicts on clean bursts, the follower's own CPU.

Every command starts real servers: run it under the shared lock, ``flock /tmp/repro-e2e.lock python
benchmarks/ledger_proof.py …``. Results print as one JSON line per run and a summary; copy the numbers into
``benchmarks/RESULTS.md``.

- ``latency [--repeats 10] [--stall-repeats 0] [--prewarm 1] [--only smoke|30760-extra|30760-drift]``: each deadlock variant
  (smoke ``extra_collective``; #30760 ``extra_collective`` and ``allocatable_drift``) ``--repeats`` times with the
  default detect stage (ledger proof first). A deadlocked server cannot be re-armed, so every run pays a start-up
  (the one cost here: ~50-100 s on the 2-core testbed, the burst and proof take seconds). Per run: verdict, proof
  kind, ``proof_latency_s`` (enter of the record that closed the proof → verdict), ``last_progress_to_verdict_s``,
  ``ledger_follow_cpu_s``, and the stall rule's figure for the same run, derived: ``stall_s`` + the time the
  proof's own confirming capture took (the stall rule runs the same two captures after ``stall_s`` of silence),
  with what the stall rule said of those captures. With ``--stall-repeats`` > 0 also that many runs with the stall
  rule alone (the figure measured, not derived).
- ``clean [--bursts 20] [--desync-repeats 10]``: ONE server (nothing here hangs it, so every burst re-arms it):
  ``control``, then ``desync_control`` and ``desync_reduce_op`` alternated ``--desync-repeats`` times, then
  ``--bursts`` clean ``control`` bursts. Any DEADLOCKED or DESYNCED on a control burst is a false one; every
  ``desync_reduce_op`` must end DESYNCED. The clean bursts come after the desyncs on the same server, so a desync
  that leaked into a later burst's verdict would show as a false one.
- ``throughput [--pairs 5] [--servers on,off] [--requests 16] [--max-new-tokens 64]``: one smoke server per item of
  ``--servers``, each with the ledger on or off (``ledger = false``), all running at once; ``--pairs`` rounds, each
  one ``control`` burst per server, the order rotated by one per round (after one uncounted warm-up burst each);
  output tokens/s per burst (requests × max_new_tokens / burst seconds); per server against the first ``off`` one:
  the ratio of the medians, the per-round ratios and their geometric mean with a 95 % interval. ``on,off,off``
  puts an A/A control (two identical off servers) next to on/off in the same run: what the set-up itself gives.
  Per burst also every thread's CPU and wake-ups, summed by server, role and thread name (as ``profile``), and the
  box's /proc/stat split (user, system, idle, steal).
- ``alternate [--bursts 30] [--window-s 1.0]``: ONE smoke server with the ledger on that records only in even
  windows of ``--window-s`` wall seconds and passes collectives straight through in odd ones (the injector's
  benchmark-only ``bench_alternate_s``); every scheduler tick's start goes to ``ticks-<pid>.txt`` in both. Each step
  (tick k → k + 1 inside a burst) counts for the window its start falls in: steps per second on vs off, pooled,
  per burst (geometric mean, 95 % interval) and as median step times. On and off share the server and alternate
  every second, so neither the two-server set-up nor the box's slow swings enter the ratio.
- ``profile [--pairs 2] [--pyspy]``: the throughput set-up (two smoke servers, ledger on and off), and around each
  burst every thread's CPU time (``/proc/<pid>/task/<tid>/stat``, utime + stime) and voluntary context switches
  (wake-ups) of both servers' processes and of this harness process, as deltas per burst, grouped by process and
  thread name; with ``--pyspy`` one more on-burst under ``py-spy record --nonblocking --gil`` on rank 0 (its
  folded stacks are printed, top 25). Where the ledger-on server's extra time goes.

Lock time (2-core testbed, measured in benchmarks/RESULTS.md): latency ≈ 70-110 s per run; clean ≈ start-up +
~5 s per burst; throughput ≈ one start-up (all servers at once, 35-95 s) + servers × pairs bursts of ~8 s;
alternate ≈ one start-up + bursts × ~8 s (40 bursts: 5.3-6.9 min).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"
H30760 = REPO / "scenarios" / "sglang" / "hicache_prefetch_30760.toml"
CASES = {"smoke": (SMOKE, "extra_collective"), "30760-extra": (H30760, "extra_collective"),
         "30760-drift": (H30760, "allocatable_drift")}


def _emit(d: dict) -> None:
    print(json.dumps(d), flush=True)


def _prepare(path: Path, variant: str, root: Path, stall_only: bool):
    """One run prepared, its session made (not started): (opts, prepared, session)."""
    from repro import runner
    from repro.detectors import StallDetector

    opts = runner.RunOptions(scenario_path=path, variant=variant, evidence_root=root)
    p = runner.prepare(opts)
    return opts, p, runner.Session(p, detectors=[StallDetector()] if stall_only else None)  # None: default stage


def _start(prepared):
    """Start a prepared run's server (blocking: launch → healthy). Returns (opts, prepared, session, failed verdict
    or None, start-up seconds)."""
    opts, p, s = prepared
    t0 = time.time()
    try:
        failed = s.start()
    except BaseException:
        s.stop()
        raise
    return opts, p, s, failed, time.time() - t0


def _finish(started, stall_only: bool, t_lock0: float) -> dict:
    """Drive a started run's variant once (arm, burst, detect), write its evidence, end its server; one row."""
    from repro import runner
    from repro.evidence import read_json

    opts, p, s, failed, start_s = started
    t0 = time.time()
    try:
        out = runner.Outcome(failed, clean=False) if failed else s.drive(p.variant, p.evidence)
        out.timings["healthy_s"] = s.healthy_s or 0.0
        runner.finish_evidence(p, opts, p.variant, p.evidence, out, s.rank_pids, False)
        p.evidence.set_status("complete", timings=out.timings)
    finally:
        s.stop()
        s.close_drivers()
    v = read_json(p.evidence.path / "verdict.json")
    t = v.get("timings", {})
    try:
        stalls = read_json(p.evidence.path / "stalls.json")
    except Exception:
        stalls = []
    cap = next((r for r in (stalls or []) if isinstance(r, dict) and r.get("detector") == "ledger-proof"), {})
    est = (p.scenario.stall_s + t["proof_capture_s"]) if t.get("proof_capture_s") is not None else None
    return {"variant": p.variant.name, "mode": "stall-only" if stall_only else "proof", "verdict": v["verdict"],
            "proof": (v.get("proof") or {}).get("kind"), "proof_latency_s": t.get("proof_latency_s"),
            "last_progress_to_verdict_s": t.get("last_progress_to_verdict_s"),
            "stall_rule_estimate_s": est, "stall_rule_would_deadlock": cap.get("stall_rule_deadlocked"),
            "ledger_follow_cpu_s": t.get("ledger_follow_cpu_s"), "burst_s": t.get("burst_s"),
            "healthy_s": round(start_s, 1), "drive_to_stop_s": round(time.time() - t0, 1),
            "since_start_s": round(time.time() - t_lock0, 1), "reason": v.get("reason", "")[:200],
            "evidence": str(p.evidence.path)}


def _runs(path: Path, variant: str, root: Path, stall_only: bool, n: int, prewarm: int, t_lock0: float, emit,
          deadline_s: float = 0.0):
    """``n`` runs of one deadlock variant, a fresh server each (a deadlocked server cannot be re-armed). With
    ``prewarm`` = k > 0 the next k runs' servers start (in threads) while the current one is driven and torn down,
    so at most k + 1 servers exist at a time (start-up is partly waiting, not CPU; on 2 cores k = 1 pays, k = 2
    with HiCache did not: two concurrent start-ups took ~165 s each). The driven server shares the cores with a
    starting one (a loaded box: the latency figures are pessimistic, not flattered). ``deadline_s`` > 0: no server
    is started after that many seconds since ``t_lock0`` (the runs already started are finished), so a run under
    the shared lock ends on its own, before an outer ``timeout``."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    rows: list[dict] = []
    if n <= 0:
        return rows
    ex = ThreadPoolExecutor(max_workers=max(1, prewarm))
    pending: deque = deque()  # (session prepared, future of its start)
    submitted = 0

    def top_up(ahead: int) -> None:
        nonlocal submitted
        while len(pending) < ahead and submitted < n and not (deadline_s and time.time() - t_lock0 > deadline_s):
            prep = _prepare(path, variant, root, stall_only)
            pending.append((prep, ex.submit(_start, prep)))
            submitted += 1

    try:
        top_up(max(1, prewarm))
        for i in range(n):
            if not pending:
                emit(i, {"stopped": f"deadline of {deadline_s:g} s since the start reached: {i} of {n} runs made"})
                break
            started = pending.popleft()[1].result()
            top_up(prewarm)
            row = _finish(started, stall_only, t_lock0)
            rows.append(row)
            emit(i, row)
            top_up(1)
        return rows
    finally:
        # servers started ahead that nobody will drive (error, interrupt): end them now, even mid-start (their
        # wait for health then fails at once), then once more after their start returned
        for (_o, _p, s), _f in pending:
            s.stop()
        for (_o, _p, s), fut in pending:
            try:
                fut.result()
            except BaseException:
                pass
            s.stop()
        ex.shutdown(wait=True)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def latency(a: argparse.Namespace, root: Path) -> None:
    summary = {}
    t_lock0 = time.time()
    for name in a.only or list(CASES):
        path, variant = CASES[name]
        rows = _runs(path, variant, root, False, a.repeats, a.prewarm, t_lock0,
                     lambda i, r: _emit({"case": name, "i": i, **r}), a.deadline_s)
        stall = _runs(path, variant, root, True, a.stall_repeats, a.prewarm, t_lock0,
                      lambda i, r: _emit({"case": name, "i": i, **r}), a.deadline_s)
        lat = [r["proof_latency_s"] for r in rows if r["proof_latency_s"] is not None]
        lp = [r["last_progress_to_verdict_s"] for r in rows if r["last_progress_to_verdict_s"] is not None]
        summary[name] = {"runs": len(rows), "deadlocked_with_proof": sum(1 for r in rows if r["verdict"] == "DEADLOCKED"
                                                                        and r["proof"]),
                         "proof_kinds": sorted({r["proof"] for r in rows if r["proof"]}),
                         "proof_latency_median_s": statistics.median(lat) if lat else None,
                         "proof_latency_max_s": max(lat) if lat else None,
                         "last_progress_to_verdict_median_s": statistics.median(lp) if lp else None,
                         "last_progress_to_verdict_max_s": max(lp) if lp else None,
                         "follower_cpu_s_max": max((r["ledger_follow_cpu_s"] or 0) for r in rows) if rows else None,
                         "stall_rule_estimate_median_s": _median([r["stall_rule_estimate_s"] for r in rows]),
                         "stall_rule_would_deadlock": [r["stall_rule_would_deadlock"] for r in rows],
                         "healthy_median_s": _median([r["healthy_s"] for r in rows]),
                         "drive_to_stop_median_s": _median([r["drive_to_stop_s"] for r in rows]),
                         "stall_only_last_progress_to_verdict_s": [r["last_progress_to_verdict_s"] for r in stall],
                         "stall_only_verdicts": [r["verdict"] for r in stall]}
    _emit({"summary": summary})


def clean(a: argparse.Namespace, root: Path) -> None:
    from repro import runner

    items = [runner.VariantItem("control", label="control-first")]
    for i in range(a.desync_repeats):
        items += [runner.VariantItem("desync_control", label=f"desync_control-{i}"),
                  runner.VariantItem("desync_reduce_op", label=f"desync_reduce_op-{i}")]
    items += [runner.VariantItem("control", label=f"control-{i}") for i in range(a.bursts)]
    names = ["control", "desync_control", "desync_reduce_op"]
    opts = runner.RunOptions(scenario_path=SMOKE, evidence_root=root)
    p = runner.prepare(opts, label_default="session", variants=names)
    session = runner.make_session(p)
    rows: list[dict] = []
    t0 = time.time()

    def on_result(d) -> None:
        v = d.outcome.verdict
        t = d.outcome.timings
        row = {"i": d.index, "variant": d.item.variant, "label": d.item.label, "verdict": v.verdict,
               "ok": d.result.requests_ok, "total": d.result.requests_total, "burst_s": round(t.get("burst_s", 0), 2),
               "follower_cpu_s": t.get("ledger_follow_cpu_s"), "clean": d.outcome.clean,
               "t_s": round(time.time() - t0, 1), "evidence": str(d.run_dir.path)}
        if v.verdict != ("DESYNCED" if d.item.variant == "desync_reduce_op" else "ALL REQUESTS SUCCEEDED"):
            row["reason"] = v.reason[:300]
        rows.append(row)
        _emit(row)

    try:
        runner.run_variants(session, opts, items, on_result)
    finally:
        session.stop()
        session.close_drivers()

    def count(variant: str, first: "bool | None" = None) -> dict:
        vs = [r["verdict"] for r in rows if r["variant"] == variant
              and (first is None or (r["label"] == "control-first") == first)]
        return {v: vs.count(v) for v in sorted(set(vs))}

    controls = [r for r in rows if r["variant"] in ("control", "desync_control")]
    _emit({"summary": {"healthy_s": round(session.healthy_s or 0, 1), "wall_s": round(time.time() - t0, 1),
                       "restarts_needed": sum(1 for r in rows if not r["clean"]),
                       "desync_reduce_op": count("desync_reduce_op"), "desync_control": count("desync_control"),
                       "clean_bursts": count("control", False), "first_control": count("control", True),
                       "false_deadlocks": sum(1 for r in controls if r["verdict"] == "DEADLOCKED"),
                       "false_desyncs": sum(1 for r in controls if r["verdict"] == "DESYNCED"),
                       "follower_cpu_s_max": max((r["follower_cpu_s"] or 0) for r in rows) if rows else None}})


def _server_specs(spec: str) -> list:
    """``--servers on,off,off`` -> [("A", True), ("B", False), ("C", False)]: one server per item, ledger on or off."""
    items = [x.strip() for x in spec.split(",") if x.strip()]
    if len(items) < 2 or any(x not in ("on", "off") for x in items):
        raise SystemExit(f"--servers: expected at least two of on/off separated by commas (e.g. on,off,off), got {spec!r}")
    return [(chr(ord("A") + i), x == "on") for i, x in enumerate(items)]


def _proc_stat() -> list:
    """The box's CPU time so far from /proc/stat's first line, seconds: [user+nice, system+irq+softirq, idle+iowait, steal]."""
    import os

    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    return [(f[0] + f[1]) / tick, (f[2] + f[5] + f[6]) / tick, (f[3] + f[4]) / tick, (f[7] if len(f) > 7 else 0) / tick]


def _log_ratio_ci(ratios: list) -> dict:
    """Geometric mean of per-round ratios and its 95 % interval (t on the log ratios); the interval says what the
    number of rounds can resolve."""
    import math

    logs = [math.log(x) for x in ratios]
    n = len(logs)
    m = statistics.mean(logs)
    if n < 2:
        return {"geo_mean": round(math.exp(m), 4), "n": n}
    se = statistics.stdev(logs) / math.sqrt(n)
    t = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26, 11: 2.23, 12: 2.20,
         13: 2.18, 14: 2.16, 15: 2.14, 16: 2.13, 17: 2.12, 18: 2.11, 19: 2.10, 20: 2.09}.get(n, 2.05)
    return {"geo_mean": round(math.exp(m), 4), "ci95": [round(math.exp(m - t * se), 4), round(math.exp(m + t * se), 4)],
            "n": n, "sd_log": round(statistics.stdev(logs), 4)}


def throughput(a: argparse.Namespace, root: Path) -> None:
    """``--servers`` (default ``on,off``) smoke servers at once, each with the ledger on or off; in every round each
    server gets one ``control`` burst, the order rotated by one per round (a Latin square: every server is in
    every position equally often over ``len(servers)`` rounds). With two servers of the same setting (``off,off``,
    or ``on,off,off``) the run measures the set-up's own bias (an A/A control) next to on/off. Per burst also the
    box's /proc/stat CPU split (user, system, idle, steal) and every thread's CPU."""
    from repro import runner
    from repro.evidence import EvidenceDir

    specs = _server_specs(a.servers)
    tmp = Path(tempfile.mkdtemp(prefix="repro-tput-"))
    text = SMOKE.read_text()
    text = re.sub(r"max_new_tokens = \d+", f"max_new_tokens = {a.max_new_tokens}", text)
    text = re.sub(r"requests = \d+", f"requests = {a.requests}", text)
    text = re.sub(r"concurrency = \d+", "concurrency = 8", text)
    sessions = {}
    try:
        from concurrent.futures import ThreadPoolExecutor

        for name, on in specs:
            path = tmp / f"{name}.toml"
            path.write_text(text.replace("budget_s = 90", "budget_s = 600" + ("" if on else "\nledger = false")))
            p = runner.prepare(runner.RunOptions(scenario_path=path, variant="control", evidence_root=root,
                                                 label=f"tput-{name}-{'on' if on else 'off'}"))
            sessions[name] = (p, runner.Session(p))
        ledger_of = dict(specs)
        _emit({"servers": {n: ("on" if o else "off") for n, o in specs}})
        t0 = time.time()
        with ThreadPoolExecutor(max_workers=len(specs)) as ex:  # all start-ups at once: one start-up of lock time
            failed = dict(zip(sessions, ex.map(lambda ps: ps[1].start(), sessions.values())))
        for name, f in failed.items():
            if f:
                raise SystemExit(f"{name}: {f.reason}")
        _emit({"healthy_s": round(time.time() - t0, 1)})
        for name, (p, s) in sessions.items():  # one warm-up burst each, not counted (a fresh server's first burst
            d = EvidenceDir(p.evidence.root, p.scenario.name, f"tput-{name}-warmup")  # ran 1.8x slower, measured)
            out = s.drive(p.scenario.variant("control"), d)
            _emit({"warmup": name, "verdict": out.verdict.verdict, "burst_s": out.timings["burst_s"]})
        tps: dict = {n: [] for n, _ in specs}
        cpu = []
        pids = _server_pids(sessions)
        names = [n for n, _ in specs]
        for i in range(a.pairs):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                p, s = sessions[name]
                d = EvidenceDir(p.evidence.root, p.scenario.name, f"tput-{name}-{i}")
                before, st0 = _thread_cpu(pids), _proc_stat()
                out = s.drive(p.scenario.variant("control"), d)
                st = [round(y - x, 2) for x, y in zip(st0, _proc_stat())]
                led = "on" if ledger_of[name] else "off"
                _emit({"pair": i, "server": name, "ledger": led, "threads": _by_role(_delta(before, _thread_cpu(pids)))})
                rate = a.requests * a.max_new_tokens / out.timings["burst_s"]
                tps[name].append(rate)
                if ledger_of[name]:
                    cpu.append(out.timings.get("ledger_follow_cpu_s"))
                _emit({"pair": i, "server": name, "ledger": led, "verdict": out.verdict.verdict,
                       "burst_s": out.timings["burst_s"], "tokens_per_s": round(rate, 1),
                       "box_cpu_s": dict(zip(("user", "system", "idle", "steal"), st)),
                       "follower_cpu_s": out.timings.get("ledger_follow_cpu_s")})
        ref = next(n for n, o in specs if not o) if any(not o for _, o in specs) else names[0]
        comparisons = {}
        for name, on in specs:
            if name == ref:
                continue
            per = [x / y for x, y in zip(tps[name], tps[ref])]
            comparisons[f"{name}({'on' if on else 'off'})/{ref}(off)" if not ledger_of[ref] else f"{name}/{ref}"] = {
                "ratio_of_medians": round(statistics.median(tps[name]) / statistics.median(tps[ref]), 4),
                "per_round_ratios": [round(x, 4) for x in per], "per_round_median": round(statistics.median(per), 4),
                "per_round_min": round(min(per), 4), "per_round_max": round(max(per), 4), **_log_ratio_ci(per)}
        _emit({"summary": {"rounds": a.pairs, "servers": {n: ("on" if o else "off") for n, o in specs},
                           "median_tokens_per_s": {n: round(statistics.median(v), 1) for n, v in tps.items()},
                           "comparisons": comparisons, "follower_cpu_s_per_burst": cpu}})
    finally:
        for _p, s in sessions.values():
            s.stop()
            s.close_drivers()


def _alternate_rates(injector_dir: Path, window_s: float, bursts: list) -> dict:
    """Step times with the ledger on and off, per rank and burst, from one server's ``ticks-<pid>.txt`` (every
    scheduler tick's start, written with ``bench_alternate_s`` = ``window_s``). A step is tick k → k + 1 inside a
    burst; it belongs to the window its start falls in (even: recording, odd: pass-through), so a window edge inside
    a long step favours neither arm. ``bursts``: [(label, t_first_sent, t_last_done)]. Returns {rank: [{burst,
    on: [step s], off: [step s]}]} (rank from the pid's ledger header)."""
    import glob
    import json as _json

    out: dict = {}
    for f in sorted(glob.glob(str(injector_dir / "ticks-*.txt"))):
        pid = Path(f).stem.split("-", 1)[1]
        rank = None
        try:
            head = _json.loads(open(injector_dir / f"ledger-{pid}.jsonl").readline())
            rank = head.get("rank")
        except (OSError, ValueError):
            pass
        if rank is None:
            continue
        ticks = {}
        for line in open(f):
            parts = line.split()
            if len(parts) >= 2:
                ticks[int(parts[0])] = [float(x) for x in parts[1:]]
        rows = []
        for label, t0, t1 in bursts:
            row = {"burst": label, "on": [], "off": [], "on_parts": [], "off_parts": []}
            for k in sorted(ticks):
                a, b = ticks[k], ticks.get(k + 1)
                if b is not None and t0 <= a[0] and b[0] <= t1:
                    arm = "off" if int(a[0] / window_s) & 1 else "on"
                    row[arm].append(b[0] - a[0])
                    if len(a) == len(b) and len(a) >= 5:  # thread CPU, hot path, writer CPU, wake-ups[, gc s, full gcs]
                        row[arm + "_parts"].append([y - x for x, y in zip(a[1:], b[1:])])
            rows.append(row)
        out[rank] = rows
    return out


def alternate_summary(injector_dir: Path, window_s: float, bursts: list, knob: str = "bench_alternate_s") -> dict:
    """The ``alternate`` summary (printed as one JSON line per rank's bursts, returned as the summary) from one
    server's ``ticks-<pid>.txt`` and ``bursts`` [(label, t_first, t_last)] (see :func:`_alternate_rates`)."""
    a = argparse.Namespace(bursts=len(bursts), window_s=window_s)
    rates = _alternate_rates(injector_dir, a.window_s, bursts)
    summary: dict = {"bursts": a.bursts, "window_s": a.window_s, "alternating": knob}
    for rk, rows in sorted(rates.items()):
        rows = [r for r in rows if r["on"] and r["off"]]
        per = [(len(r["on"]) / sum(r["on"])) / (len(r["off"]) / sum(r["off"])) for r in rows]
        on = [x for r in rows for x in r["on"]]
        off = [x for r in rows for x in r["off"]]
        _emit({"rank": rk, "per_burst": [{"burst": r["burst"], "on_steps": len(r["on"]), "on_s": round(sum(r["on"]), 3),
                                          "off_steps": len(r["off"]), "off_s": round(sum(r["off"]), 3)} for r in rows]})
        if not on or not off:
            continue
        q = lambda xs, f: sorted(xs)[int(f * (len(xs) - 1))]  # noqa: E731
        parts = {}
        for arm in ("on", "off"):  # per step, milliseconds: where a step's time went, by arm
            ps = [x for r in rows for x in r[arm + "_parts"]]
            if ps:
                n = len(ps)
                parts[arm] = {"main_thread_cpu_ms": round(1000 * sum(x[0] for x in ps) / n, 3),
                              "hot_path_ms": round(1000 * sum(x[1] for x in ps) / n, 4),
                              "writer_cpu_ms": round(1000 * sum(x[2] for x in ps) / n, 4),
                              "writer_wakes_per_step": round(sum(x[3] for x in ps) / n, 4)}
                if len(ps[0]) >= 6:
                    parts[arm].update(gc_ms=round(1000 * sum(x[4] for x in ps) / n, 4),
                                      full_gcs_per_100_steps=round(100 * sum(x[5] for x in ps) / n, 3))
        summary[f"rank{rk}"] = {
            "steps": [len(on), len(off)], "on_steps_per_s": round(len(on) / sum(on), 3),
            "off_steps_per_s": round(len(off) / sum(off), 3),
            "pooled_ratio_on_off": round((len(on) / sum(on)) / (len(off) / sum(off)), 4),
            "median_step_ms": [round(1000 * statistics.median(on), 2), round(1000 * statistics.median(off), 2)],
            "median_step_ratio_off_on": round(statistics.median(off) / statistics.median(on), 4),
            "p90_step_ms": [round(1000 * q(on, 0.9), 1), round(1000 * q(off, 0.9), 1)],
            "per_burst_ratio_median": round(statistics.median(per), 4), "per_burst_ratio_min": round(min(per), 4),
            "per_burst_ratio_max": round(max(per), 4), **_log_ratio_ci(per), "per_step": parts}
    return summary


def alternate(a: argparse.Namespace, root: Path) -> None:
    """ONE smoke server with the ledger on, recording only in even windows of ``--window-s`` wall seconds
    (``bench_alternate_s``): on and off alternate every window inside every burst, on the same server, so the
    box's slow swings (the same 1,024 tokens took 4.9-7.8 s between bursts) and any difference between two servers
    fall on both arms alike. The off arm keeps the wrappers installed, passing straight through (a Python call and
    a clock read per collective, ~7 collectives a step); both arms log each tick's start (``ticks-<pid>.txt``). No
    ledger proof runs (the ranks' ledgers disagree at every window edge by design): the detect stage is the
    rank-death and stall rules only, so the follower's own CPU (``throughput`` measures it) is not in this ratio."""
    from repro import runner
    from repro.checker import RankDeathDetector
    from repro.detectors import StallDetector
    from repro.evidence import EvidenceDir

    tmp = Path(tempfile.mkdtemp(prefix="repro-alt-"))
    text = SMOKE.read_text()
    text = re.sub(r"max_new_tokens = \d+", f"max_new_tokens = {a.max_new_tokens}", text)
    text = re.sub(r"requests = \d+", f"requests = {a.requests}", text)
    text = re.sub(r"concurrency = \d+", "concurrency = 8", text)
    path = tmp / "alt.toml"
    path.write_text(text.replace("budget_s = 90", "budget_s = 600"))
    p = runner.prepare(runner.RunOptions(scenario_path=path, variant="control", evidence_root=root, label="alternate"))
    knob = getattr(a, "knob", "bench_alternate_s")  # benchmarks/digest_overhead.py: bench_digest_alternate_s
    if knob == "bench_digest_alternate_s" and not (p.plan["ledger"].get("digest") or {}).get("enabled"):
        raise SystemExit("the scenario's plan has no state digest (no probe file for this release, or digest = false)")
    p.plan["ledger"][knob] = a.window_s
    p.evidence.plan.write(p.plan)
    s = runner.Session(p, detectors=[RankDeathDetector(), StallDetector()])
    try:
        t0 = time.time()
        failed = s.start()
        if failed:
            raise SystemExit(f"start: {failed.reason}")
        _emit({"healthy_s": round(time.time() - t0, 1), "window_s": a.window_s, "alternating": knob})
        d = EvidenceDir(p.evidence.root, p.scenario.name, "alt-warmup")
        out = s.drive(p.scenario.variant("control"), d)
        _emit({"warmup": True, "verdict": out.verdict.verdict, "burst_s": out.timings["burst_s"]})
        bursts = []
        for i in range(a.bursts):
            d = EvidenceDir(p.evidence.root, p.scenario.name, f"alt-{i}")
            st0 = _proc_stat()
            out = s.drive(p.scenario.variant("control"), d)
            st = [round(y - x, 2) for x, y in zip(st0, _proc_stat())]
            ev = [json.loads(x) for x in (d.path / "requests.jsonl").read_text().splitlines() if x.strip()]
            ts = [e["t"] for e in ev if e.get("event") in ("sent", "done")]
            bursts.append((str(i), min(ts), max(ts)))
            _emit({"burst": i, "verdict": out.verdict.verdict, "burst_s": round(out.timings["burst_s"], 3),
                   "tokens_per_s": round(a.requests * a.max_new_tokens / out.timings["burst_s"], 1),
                   "box_cpu_s": dict(zip(("user", "system", "idle", "steal"), st))})
        time.sleep(0.5)  # the last records reach disk (the writer's period is 0.15 s)
        _emit({"summary": alternate_summary(p.evidence.injector_dir, a.window_s, bursts, knob)})
    finally:
        s.stop()
        s.close_drivers()


def _thread_cpu(pids: dict) -> dict:
    """(label, thread name) -> [cpu seconds, voluntary context switches] over every thread of ``pids`` (label -> pid)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    out: dict = {}
    for label, pid in pids.items():
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                stat = open(f"/proc/{pid}/task/{tid}/stat").read()
                status = open(f"/proc/{pid}/task/{tid}/status").read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            f = stat[stat.rindex(")") + 2:].split()
            cpu = (int(f[11]) + int(f[12])) / tick
            vol = int(re.search(r"voluntary_ctxt_switches:\s+(\d+)", status).group(1))
            key = (label, name)
            acc = out.setdefault(key, [0.0, 0, 0])
            acc[0] += cpu
            acc[1] += vol
            acc[2] += 1
    return out


def _delta(before: dict, after: dict) -> dict:
    return {f"{k[0]}|{k[1]}": [round(v[0] - before.get(k, [0, 0])[0], 3), v[1] - before.get(k, [0, 0])[1], v[2]]
            for k, v in after.items() if v[0] - before.get(k, [0, 0])[0] > 0.004 or v[1] - before.get(k, [0, 0])[1] > 20}


def _server_pids(sessions: dict) -> dict:
    """label (``on:rank0:<pid>``, ``off:proc:<pid>``, ``harness``) -> pid of both servers' processes and this one."""
    import os

    pids: dict = {"harness": os.getpid()}
    for name, (_p, s) in sessions.items():
        for pi in s.server.procs():
            rk = next((r for r, q in s.rank_pids.items() if q == pi.pid), None)
            pids[f"{name}:{'proc' if rk is None else f'rank{rk}'}:{pi.pid}"] = pi.pid
    return pids


def _by_role(delta: dict) -> dict:
    """Per-thread deltas summed by (server, role, thread name): ``on:rank0|python`` -> [cpu s, wake-ups]."""
    out: dict = {}
    for k, v in delta.items():
        lab, name = k.split("|", 1)
        role = ":".join(lab.split(":")[:2])
        acc = out.setdefault(f"{role}|{name}", [0.0, 0])
        acc[0] = round(acc[0] + v[0], 3)
        acc[1] += v[1]
    return dict(sorted(out.items(), key=lambda kv: -kv[1][0]))


def profile(a: argparse.Namespace, root: Path) -> None:
    import os
    import subprocess

    from repro import runner
    from repro.evidence import EvidenceDir

    tmp = Path(tempfile.mkdtemp(prefix="repro-prof-"))
    text = SMOKE.read_text()
    text = re.sub(r"max_new_tokens = \d+", f"max_new_tokens = {a.max_new_tokens}", text)
    text = re.sub(r"requests = \d+", f"requests = {a.requests}", text)
    text = re.sub(r"concurrency = \d+", "concurrency = 8", text)
    on, off = tmp / "on.toml", tmp / "off.toml"
    on.write_text(text.replace("budget_s = 90", "budget_s = 600"))
    off.write_text(text.replace("budget_s = 90", "budget_s = 600\nledger = false"))
    sessions = {}
    try:
        from concurrent.futures import ThreadPoolExecutor

        for name, path in (("on", on), ("off", off)):
            p = runner.prepare(runner.RunOptions(scenario_path=path, variant="control", evidence_root=root,
                                                 label=f"prof-{name}"))
            sessions[name] = (p, runner.Session(p))
        t0 = time.time()
        with ThreadPoolExecutor(max_workers=2) as ex:
            failed = dict(zip(sessions, ex.map(lambda ps: ps[1].start(), sessions.values())))
        for name, f in failed.items():
            if f:
                raise SystemExit(f"{name}: {f.reason}")
        _emit({"healthy_s": round(time.time() - t0, 1)})
        pids = _server_pids(sessions)
        _emit({"pids": pids})
        for name, (p, s) in sessions.items():
            d = EvidenceDir(p.evidence.root, p.scenario.name, f"prof-{name}-warmup")
            out = s.drive(p.scenario.variant("control"), d)
            _emit({"warmup": name, "verdict": out.verdict.verdict, "burst_s": out.timings["burst_s"]})

        def burst(name: str, tag: str, pyspy: bool = False) -> None:
            p, s = sessions[name]
            d = EvidenceDir(p.evidence.root, p.scenario.name, f"prof-{name}-{tag}")
            spy = None
            if pyspy:
                rank0 = s.rank_pids[min(s.rank_pids)]
                spy_out = tmp / f"pyspy-{name}-{tag}.txt"
                spy = subprocess.Popen(["py-spy", "record", "--nonblocking", "--gil", "--threads", "-r", "50", "-f",
                                        "raw", "-o", str(spy_out), "-p", str(rank0)], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
                time.sleep(1.0)
            b = _thread_cpu(pids)
            w0 = time.time()
            out = s.drive(p.scenario.variant("control"), d)
            wall = time.time() - w0
            dl = _delta(b, _thread_cpu(pids))
            if spy is not None:
                import signal as _sig
                os.killpg(spy.pid, _sig.SIGINT)
                try:
                    spy.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(spy.pid, _sig.SIGKILL)
                    spy.wait()
            rate = a.requests * a.max_new_tokens / out.timings["burst_s"]
            _emit({"burst": tag, "ledger": name, "verdict": out.verdict.verdict, "burst_s": out.timings["burst_s"],
                   "wall_s": round(wall, 2), "tokens_per_s": round(rate, 1),
                   "follower_cpu_s": out.timings.get("ledger_follow_cpu_s"), "threads": _by_role(dl)})
            if spy is not None and spy_out.exists():
                rows = []
                for line in spy_out.read_text().splitlines():
                    stack, _, n = line.rpartition(" ")
                    if n.isdigit():
                        rows.append((int(n), stack))
                total = sum(n for n, _ in rows) or 1
                leaf: dict = {}
                for n, stack in rows:
                    frames = stack.split(";")
                    key = frames[0] + " .. " + ";".join(frames[-3:])
                    leaf[key] = leaf.get(key, 0) + n
                _emit({"pyspy_samples": total, "top": [(round(n / total, 4), k) for k, n in
                                                       sorted(leaf.items(), key=lambda kv: -kv[1])[:25]]})
                ledger = sum(n for n, st in rows if "repro_ledger" in st or "_ledger.py" in st or "repro-ledger" in st)
                _emit({"pyspy_ledger_share": round(ledger / total, 4), "raw": str(spy_out)})

        for i in range(a.pairs):
            for name in (("on", "off") if i % 2 == 0 else ("off", "on")):
                burst(name, str(i))
        if a.pyspy:
            burst("on", "pyspy", pyspy=True)
    finally:
        for _p, s in sessions.values():
            s.stop()
            s.close_drivers()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("latency")
    la.add_argument("--repeats", type=int, default=10)
    la.add_argument("--stall-repeats", type=int, default=0)
    la.add_argument("--only", nargs="*", choices=list(CASES))
    la.add_argument("--prewarm", type=int, default=1,
                    help="servers started ahead while the current run is driven (0: strictly one at a time)")
    la.add_argument("--deadline-s", type=float, default=0.0,
                    help="start no server after this many seconds (0: no limit); keeps a run inside the lock's turn")
    cl = sub.add_parser("clean")
    cl.add_argument("--bursts", type=int, default=20)
    cl.add_argument("--desync-repeats", type=int, default=10)
    tp = sub.add_parser("throughput")
    tp.add_argument("--pairs", type=int, default=5, help="rounds: one burst per server each")
    tp.add_argument("--servers", default="on,off",
                    help="one smoke server per item, ledger on or off (on,off,off: on/off next to an off/off A/A control)")
    tp.add_argument("--requests", type=int, default=16)
    tp.add_argument("--max-new-tokens", type=int, default=64)
    al = sub.add_parser("alternate")
    al.add_argument("--bursts", type=int, default=30)
    al.add_argument("--window-s", type=float, default=1.0)
    al.add_argument("--requests", type=int, default=16)
    al.add_argument("--max-new-tokens", type=int, default=64)
    pr = sub.add_parser("profile")
    pr.add_argument("--pairs", type=int, default=2)
    pr.add_argument("--requests", type=int, default=16)
    pr.add_argument("--max-new-tokens", type=int, default=64)
    pr.add_argument("--pyspy", action="store_true")
    ap.add_argument("--evidence-dir", default="")
    a = ap.parse_args()
    import signal

    def _term(signum, frame):  # SIGTERM (an outer `timeout`) tears the servers down like Ctrl-C
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    root = Path(a.evidence_dir) if a.evidence_dir else Path(tempfile.mkdtemp(prefix="repro-bench-proof-"))
    {"latency": latency, "clean": clean, "throughput": throughput, "alternate": alternate,
     "profile": profile}[a.cmd](a, root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
