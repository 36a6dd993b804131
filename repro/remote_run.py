"""``python -m repro.remote_run``: ``repro run`` of a server spanning several hosts (the session:
:mod:`repro.multihost`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from repro import evidence as ev
from repro.hosts import HostSpec, hosts_from_json
from repro.runner import (Observer, RunOptions, RunResult, VariantItem, _noop, make_session, prepare, run_prepared,
                          run_variants)
from repro.verdict import exit_code_for


def run_multihost(opts: RunOptions, hosts: Sequence[HostSpec], observe: Observer = _noop) -> RunResult:
    """``repro run`` for a server spanning ``hosts``: ``repro.runner.run_prepared`` on a :class:`MultiHostSession`
    (launch, arm, drive, capture on each host, judge, evidence, stop).

    Never leaves a node running: every node is stopped on every outcome and on Ctrl-C (KeyboardInterrupt re-raised
    after teardown); what a stop left is in ``teardown.json`` (``by_host``).

    Raises:
        repro.runner.RunError: bad scenario or options (nothing launched).
    """
    p = prepare(opts)
    if not opts.command_line:
        opts = dataclasses.replace(opts, command_line=f"python -m repro.remote_run {opts.scenario_path}")
    return run_prepared(p, opts, observe, session=make_session(p, observe, hosts=hosts))


def run_multihost_many(opts: RunOptions, variants: Sequence[str], hosts: Sequence[HostSpec],
                       observe: Observer = _noop, on_result: Optional[Callable[[RunResult], None]] = None
                       ) -> tuple[list[RunResult], dict[str, list]]:
    """Several variants of one scenario on ONE server spanning ``hosts``: ``repro.runner.run_variants`` (the one
    multi-variant loop) on a :class:`MultiHostSession`.

    The plan holds every listed variant's injections (ids unique across them); each variant is armed in turn and
    gets its own run folder (``session.json`` names the session folder; ``hosts/<host>/`` holds that host's log and
    injector records as they were when the variant ended). A variant that leaves the server unusable (a hang, a
    crash, requests outstanding) makes the server restart before the next one (never after the last). The session
    folder keeps ``teardown.json`` of the last stop. Every node is stopped at the end, on failure and on Ctrl-C.
    Each RunResult's exit code is the verdict's own (``--expect`` when given), as a single ``--hosts`` run's.

    Args:
        on_result: called with each variant's RunResult as soon as its folder is complete.
    Returns:
        (one RunResult per variant, in order; host -> pids left running after the final stop, empty lists: clean).
    Raises:
        repro.runner.RunError: bad scenario or options (nothing launched).
        KeyboardInterrupt: after teardown.
    """
    p = prepare(opts, label_default="session", variants=variants)
    command = opts.command_line or f"python -m repro.remote_run {opts.scenario_path}"
    p.evidence.command.write(command + "\n")
    session = make_session(p, observe, hosts=hosts)
    results: list[RunResult] = []
    left: dict = {"?": ["teardown interrupted"]}
    interrupted = False

    def collect(d: Any) -> None:
        res = dataclasses.replace(d.result, exit_code=exit_code_for(d.result.verdict.verdict, opts.expect))
        results.append(res)
        if on_result is not None:
            on_result(res)

    try:
        run_variants(session, opts, [VariantItem(name, command=command) for name in variants], collect)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        left = session.stop()
        session.close_drivers()
        p.evidence.set_status("interrupted" if interrupted else "complete")
    if interrupted:
        raise KeyboardInterrupt
    return results, left


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI: ``python -m repro.remote_run SCENARIO --hosts HOSTS.json [--variant V ...] [--evidence-dir D] [--expect E]``.

    One ``--variant``: prints the verdict line and the evidence folder, then one JSON line; exit code as ``repro
    run`` (2 on bad input). Several ``--variant``: they run in turn on one server (:func:`run_multihost_many`); one
    verdict line, folder and JSON line (with ``variant``) per variant, then a JSON line ``{"session": …,
    "left_running": …}``; exit code 0 when every variant's is 0, else the first non-zero one (1 when a node was
    left running).
    """
    from repro.runner import RunError

    ap = argparse.ArgumentParser(prog="python -m repro.remote_run", description="repro run across several hosts")
    ap.add_argument("scenario", type=Path)
    ap.add_argument("--hosts", type=Path, required=True, help="JSON list of hosts (repro.hosts.HostSpec fields)")
    ap.add_argument("--variant", action="append",
                    help="variant to run; give it several times to run them in turn on one server")
    ap.add_argument("--evidence-dir", type=Path, default=ev.DEFAULT_EVIDENCE_DIR)
    ap.add_argument("--expect")
    ap.add_argument("--requests", type=int)
    a = ap.parse_args(argv)
    try:
        hosts = hosts_from_json(json.loads(a.hosts.read_text()))
    except (OSError, ValueError) as e:
        print(f"error: {a.hosts}: {e}", file=sys.stderr)
        return 2
    variants = a.variant or []
    opts = RunOptions(scenario_path=a.scenario, variant=variants[0] if variants else None, evidence_root=a.evidence_dir,
                      expect=a.expect, requests=a.requests,
                      command_line=" ".join(["python -m repro.remote_run", *map(shlex.quote, argv or sys.argv[1:])]))

    def observe(e: str, d: Any) -> None:
        if e != "burst":
            print(f"[{time.strftime('%H:%M:%S')}] {e} {json.dumps(d, default=str)[:300]}", file=sys.stderr, flush=True)

    def show(res: RunResult, variant: Optional[str] = None) -> None:
        print(f"{res.verdict.verdict}: {res.verdict.reason}")
        print(f"evidence: {res.evidence}")
        print(json.dumps({**({"variant": variant} if variant else {}), "verdict": res.verdict.verdict,
                          "reason": res.verdict.reason, "evidence": str(res.evidence), "exit_code": res.exit_code}),
              flush=True)

    try:
        if len(variants) <= 1:
            res = run_multihost(opts, hosts, observe=observe)
            show(res)
            return res.exit_code
        shown = iter(variants)
        results, left = run_multihost_many(opts, variants, hosts, observe=observe,
                                           on_result=lambda r: show(r, next(shown)))
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    session = ev.EvidenceDir.open(results[0].evidence).session.read().session if results else ""
    print(json.dumps({"session": session, "left_running": left}), flush=True)
    codes = [r.exit_code for r in results if r.exit_code]
    return codes[0] if codes else (1 if any(left.values()) else 0)


if __name__ == "__main__":
    sys.exit(main())
