"""``repro watch``: probe a live server's generate path, declare a hang, keep the evidence, then run ``--on-hang``.

The incident this answers: a TP job wedged for 18 minutes while ``/health`` returned 200; the operator restarted it
and the forensic state was gone. The watch is the external probe of the generate path, and it writes the evidence
(every rank's stacks twice, the diagnosis, raw ``/metrics``) *before* any restart command runs.

One probe round every ``interval_s`` seconds (start to start; a round never overlaps the previous one):

- a 1-token **generate** probe (the adapter's request body: ``input_ids`` work on a tokenizer-less server), bounded
  by ``probe_timeout_s``; a probe that does not answer in time is abandoned (its connection closed by the client
  timeout) and, if its thread is somehow still running at the next round, that round's probe is *skipped* and
  counts as a failure: probes never pile up;
- a **/health** probe in its own thread, bounded by ``health_timeout_s`` (default 25 s, above sglang's 20 s), never
  more than one in flight. In sglang 0.5.23 (``srt/entrypoints/http_server.py`` ``health_generate``) ``/health``
  runs a 1-token generate and answers 503 when nothing came back for ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s); with
  ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`` it answers 200 at once, straight through a deadlock.

``failures`` consecutive generate probes that reached the server but failed (timeout, HTTP error, bad answer)
declare a hang (with ``probe_timeout_s <= interval_s`` within ``failures × interval_s + probe_timeout_s`` seconds of
its start; a timed-out round delays the next, so otherwise within ``interval_s + failures × probe_timeout_s``), reported by what ``/health`` said meanwhile: ``silent`` (200: a liveness check would not notice),
``health-error`` (e.g. 503), ``health-timeout`` (no answer yet) or ``health-unreachable``. Consecutive connection
failures (refused, DNS, connect timeout) are reported as ``unreachable`` instead: a server that is down is not hung.
A server that has never answered a generate probe successfully and answers 404/405/501 within a second, or closes
the connection at once, is *misconfigured* (not this engine's API, or a wrong URL): the watch ends with exit 8,
captures nothing and does not run ``on_hang`` (:func:`wrong_api`). After one success the same fast errors count as
failures (a router answers fast 5xx when its workers hang).

On a hang: discover the local rank processes (under ``pid_root``, by title ``match``, or under the process listening
on the URL's port), capture them all in parallel twice ``confirm_gap_s`` apart (:func:`repro.capture.capture_ranks`,
the same code as ``repro run``), analyse (:func:`repro.analysis.analyze`), apply the DEADLOCKED rule
(:func:`repro.verdict.judge_stall`), write the evidence folder (``verdict.json`` atomically, last), and only then run
``on_hang`` with ``REPRO_EVIDENCE_DIR`` set. One declaration per hang: the next needs a successful probe first.

Every probe round and every event is one JSON object handed to the ``log`` callback (the CLI prints one line each
on stdout). Library code never prints.

By role: :mod:`.options` (what was asked, exit codes), :mod:`.probes` (the generate and /health probes),
:mod:`.discovery` (the rank processes on this host), :mod:`.hosts` (on the server's hosts, ``--hosts``),
:mod:`.report` (REPORT.md), :mod:`.watcher` (the loop). This module re-exports what callers import.
"""

from __future__ import annotations

from repro.watch.options import (EVIDENCE_ENV, FALLBACK_EVIDENCE_ROOT, LEDGER_POLL_S, HISTORY_ROUNDS,
                                 ON_HANG_OUTPUT_TAIL_CHARS, EXIT_HEALTHY, EXIT_HUNG_DEADLOCK, EXIT_HUNG_NO_EVIDENCE,
                                 EXIT_UNREACHABLE, EXIT_MISCONFIGURED, LogSink, WatchConfigError, DiscoveryError,
                                 WatchOptions)
from repro.watch.probes import (PROBE_INPUT_IDS, WRONG_API_STATUSES, WRONG_API_FAST_S, OK, TIMEOUT, REFUSED,
                                HTTP_ERROR, BAD_ANSWER, SKIPPED, ERROR, INTERRUPTED, SILENT, HEALTH_ERROR,
                                HEALTH_TIMEOUT, HEALTH_UNREACHABLE, HEALTH_UNKNOWN, ProbeResult, probe_generate,
                                probe_health, wrong_api, HealthView, classify_health)
from repro.watch.discovery import (Discovery, discover_ranks)
from repro.watch.hosts import (LIST_DEADLINE_S, discover_on_hosts)
from repro.watch.report import (HangOutcome, watch_report)
from repro.watch.watcher import (Watcher)
