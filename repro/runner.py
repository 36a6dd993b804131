"""One run, end to end (docs/pipeline.md): scenario → plan → server → arm → burst → stall? → capture ×2 → verdict → evidence.

The runner wires the roles together and owns the life-cycle: the server tree is torn down on every outcome,
on Ctrl-C and on SIGTERM (the CLI turns SIGTERM into ``KeyboardInterrupt``), and the evidence folder is kept and
marked ``interrupted`` when the run does not finish. It renders nothing: progress goes to an optional observer.

The code lives in :mod:`repro.run` by role; this module re-exports every name callers import from it.
"""

from __future__ import annotations

from repro.run.options import (RunError, UnresolvedSitesError, RunOptions, RunResult, Observer, _noop, Prepared,
                               ARM_FILE_NAME)
from repro.run.prepare import (prepare, check_launch, _decide, _remove_owned, engine_plan, session_plan,
                                _looks_like_path)
from repro.run.arm import (POLL_S, ARM_ACK_TIMEOUT_S, ARM_ACK_POLL_S, write_arm_file, fire_log_offsets, wait_armed,
                           arm_and_wait)
from repro.run.records import collect_versions, injection_checks
from repro.run.finish import (Outcome, outcome_exit_code, RunEvidence, SINGLE_SERVER, snapshot_session,
                              save_server_procs, _ledger_evidence, finish_evidence)
from repro.run.session import WEDGED_STOP_GRACE_S, Session
from repro.run.loop import (make_session, run_prepared, run_one, _rewrite_exit_code, _result, VariantItem,
                            VariantDone, log_since, run_variants, run_many, run)
