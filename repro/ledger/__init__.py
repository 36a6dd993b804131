"""Collective ledgers: typed records, per-group alignment across ranks, the first divergent collective.

The injector writes one ``ledger-<pid>.jsonl`` per process (format in ``injectors/repro_injector/_ledger.py``);
this package reads them into :class:`RankLedger` records and aligns them, split as PyTorch Flight Recorder splits
types / builder / matching: :mod:`.types` (the records), :mod:`.load` (files → records), :mod:`.align` (matching:
the first divergence), :mod:`.diagnose` (a run's diagnosis and its report lines). No analysis in the collector.

Alignment (:func:`align`): for each process group, the ranks' records are lined up by per-group **sequence
number** (the Nth collective a rank entered on that group). The **first divergence** is the earliest point where
the ranks disagree:

- ``missing``: some ranks of the group entered sequence N, others never did and are blocked in another
  collective (their oldest record entered and not left, on any group, reported beside it). When a missing rank is
  not blocked in any collective (idle between ticks, or still on its way), or is still in an earlier sequence
  number of the same group, the sequence is *in flight*, not a divergence: a healthy idle server looks like that.
- ``mismatch``: all ranks entered N but with different op / reduce op / shapes / dtypes; the culprit is the rank(s)
  outside the majority (gloo pairs some of these, so they complete with wrong values instead of hanging).

Only sequence numbers present in every rank's kept window are compared (rotation drops the oldest records). When
several groups diverge, the divergence whose first record carries an injection id comes first (the nemesis' own
collective explains the others), then the earliest entered.
"""

from __future__ import annotations

from repro.ledger.align import IN_FLIGHT_MAX, align, check_consistent, divergence_tick, per_tick_counts
from repro.ledger.diagnose import LedgerDiagnosis, diagnose, diagnose_paths
from repro.ledger.load import LEDGER_RE, load_ledgers, rank_pids_of, read_ledger_files
from repro.ledger.types import Divergence, GroupInfo, LedgerError, RankLedger, Record, _tuple, short_name

__all__ = ["LedgerDiagnosis", "diagnose", "diagnose_paths", "rank_pids_of", "GroupInfo", "Record", "RankLedger",
           "Divergence", "LedgerError", "read_ledger_files", "load_ledgers", "align", "per_tick_counts",
           "check_consistent", "short_name", "divergence_tick", "IN_FLIGHT_MAX", "LEDGER_RE"]
