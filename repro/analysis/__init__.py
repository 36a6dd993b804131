"""Per-rank state from captured stacks, ranks grouped by where they are blocked, and the odd rank(s) out.

Words (docs/pipeline.md): a rank is in a **collective** when the innermost frames of its main thread (or of another
thread holding a collective while the main thread waits) are communication-layer frames; **idle-wait** when they
are a wait for work (zmq poll/recv, select, queue get, condition/event wait, thread join, pipe recv); **busy**
otherwise (on CPU, or sleeping in an injected delay, or anywhere else). Being in a collective is not a hang by
itself: idle SGLang ranks sit in ``broadcast_pyobj`` → ``dist.broadcast`` (sglang 0.5.23
``managers/scheduler_components/request_receiver.py`` ``_broadcast_reqs_across_ranks``). Two ranks in the same op
from the same call site agree; the ranks **diverge** when, with no rank busy, at least one is in a collective and
they are not all blocked at the same place (different op, different call site, or collective vs idle-wait).

Communication layers recognised (innermost outwards): native waits (``c10d::``/``gloo::``/NCCL symbols in
``--native`` dumps), ``torch.distributed`` (``torch/distributed/*``; ``monitored_barrier`` named on its own),
sglang's ``pynccl``/``custom_all_reduce`` device communicators (``distributed/device_communicators/*``),
``GroupCoordinator`` (``distributed/parallel_state.py``, ``distributed/communication_op.py``) and
``broadcast_pyobj`` (``utils/common.py`` in 0.5.23). Injector frames (``sitecustomize.py``, ``usercustomize.py``,
``repro_injector``) are shown as ``[injected]`` and are never the call site. Process groups are not visible in
stacks: ``process_group`` stays None here (the ledger fills it).

By role: :mod:`repro.frames` (what a frame is), :mod:`.types` (the records), :mod:`.ranks` (stacks → rank states →
the analysis), :mod:`.load` (files → captures). This module re-exports every name it had.

Frames are compared by function name (last component, so faulthandler's bare ``co_name`` matches py-spy's
qualified name), file base name and line.
"""

from __future__ import annotations

from repro.diagnosis import COLLECTIVE_OPS  # re-exported: the one op list
from repro.frames import (_norm_op, is_ledger_frame, is_injector_frame, injected_site, comm_layer, idle_kind,
                          _is_noise, _is_bootstrap, helper_kind, native_collective, is_op_dispatch_frame,
                          is_spin_wait)
from repro.analysis.types import (RankStateName, MAX_LISTED_LINES, ThreadReading, RankState, RankGroup, Analysis)
from repro.analysis.ranks import (read_thread, select_thread, rank_state, analyze, frames_unchanged, changed_ranks)
from repro.analysis.load import (AnalyzeInputError, is_engine_title, MAX_RANKS, MAX_RAW_TEXT_CHARS, load_captures,
                                 analyze_paths, EXPECTED_INPUT)
