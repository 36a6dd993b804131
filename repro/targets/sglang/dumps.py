"""SGLang 0.5.23's own state dumps as they appear in its log: the line patterns ``repro analyze`` reads them by.

Read from the installed sources (paths under ``sglang/srt/``):

- The scheduler's (soft) watchdog (``utils/watchdog.py`` ``WatchdogRaw._watchdog_once``): when a scheduler's batch
  makes no progress for ``--watchdog-timeout`` / ``--soft-watchdog-timeout`` seconds, each rank logs one record
  ``[<time> TP<k>] Scheduler debug info:`` whose following lines (no log prefix) come from
  ``managers/scheduler_components/invariant_checker.py`` ``create_scheduler_watchdog.dump_info``:
  ``scheduler.cur_batch_for_debug.batch_size()=N``, ``scheduler.cur_batch_for_debug.reqs=[Req(rid=…, …), …]`` and
  ``_check_all_pools``' lines ``[full] total=, available=, evictable=, protected=, session_held=, uncached=``
  (``InvariantChecker._check_pool_invariant``), plus ``[swa] …`` on hybrid SWA models and ``[mamba] …`` /
  ``[mamba-active]`` / ``[mamba-int8]`` on hybrid SSM ones; then ``Scheduler watchdog timeout
  (self.watchdog_timeout=…, self.soft=…)``. The soft watchdog keeps serving and dumps again every timeout.
- The rank consensus checker (``utils/rank_consensus_checker.py`` ``_check_for_consensus``, opt-in with
  ``SGLANG_ENABLE_RANK_CONSENSUS_CHECKER``): ``Found rank divergence for N events(s)! local hash: <hex>, events =
  […]`` on every rank, then the process exits.
- The idle leak check (``InvariantChecker._check_req_pool`` / ``_report_leak``, raised while
  ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE`` is on, the default): ``req_to_token_pool memory leak
  detected!available_size=…, session_held=…, total_size=…`` and ``pool memory leak detected! [full] …``.
"""

from __future__ import annotations

from repro.targets.base import EngineDumpRules

_PAIRS = r"(?P<pairs>\w+=.*)"

SGLANG_DUMP_RULES = EngineDumpRules(
    engine="sglang 0.5.23",
    block_header=r"^(?P<name>Scheduler debug info):\s*$",
    block_figures=(
        ("batch_size()", r"^\S*\bbatch_size\(\)=(?P<value>\S+)\s*$"),
        ("reqs", r"^\S*\breqs=(?P<members>.*)$"),
        # [full] / [swa] / [mamba] / [mamba-active] / [mamba-int8]; SWA's ring form has words before the pairs
        ("pool", r"^\[(?P<group>full|swa|mamba[\w-]*)\] (?:[^=]*?: )?" + _PAIRS + r"$"),
        ("registration", r"^symmetric-memory registration in progress: (?P<value>.*)$"),
    ),
    member_id=r"\bReq\(rid=([^,\s)]+)",
    events=(
        ("consensus_divergence", "rank consensus checker: Found rank divergence",
         r"Found rank divergence for (?P<events>\d+) events?\(s\)! local hash: (?P<hash>[0-9a-fA-F]+)"),
        ("memory_leak", "sglang idle memory leak check: memory leak detected",
         r"(?P<pool>\w+) memory leak detected! ?" + r"(?:\[(?P<group>\w[\w-]*)\] )?(?P<pairs>\w+=.*)?"),
    ),
    gate_substrings=("debug info:", "Found rank divergence", "memory leak detected", "watchdog timeout"),
    timeout_line=r"^Scheduler watchdog timeout \(self\.watchdog_timeout=(?P<timeout_s>[\d.]+), self\.soft=(?P<soft>\w+)\)",
)

__all__ = ["SGLANG_DUMP_RULES"]
