"""The 0.5.23 release file's PD transient probes read, on a PD scheduler, each KV manager's per-room KVPoll states
(a sum) and the bootstrap thread's received room infos (a count), with the injector's own digest; on a plain
server they are absent. KVPoll states are plain ints in sglang 0.5.23 (disaggregation/base/conn.py)."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "injectors"))

from repro_injector import _digest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RELEASE = REPO / "repro/targets/sglang/releases/0.5.23.toml"
PD_TRANSIENT = ("pd.prefill_kv_status.sum", "pd.prefill_transfer_infos.len", "pd.decode_kv_status.sum")


def _probes() -> list[dict]:
    data = tomllib.loads(RELEASE.read_text())
    return [p for p in data["state"]["probe"] if p["name"] in PD_TRANSIENT]


def test_pd_transient_probes_read_each_ranks_kv_states_and_bootstrap_infos(tmp_path: Path) -> None:
    probes = _probes()
    assert sorted(p["name"] for p in probes) == sorted(PD_TRANSIENT)
    assert {p["kind"] for p in probes} == {"transient"}
    # prefill: room 7 bootstrapped by this rank's bootstrap thread (WaitingForInput 2), room 8 sent (Success 4)
    mgr = SimpleNamespace(request_status={7: 2, 8: 4}, transfer_infos={7: {}, 8: {}})
    prefill = SimpleNamespace(disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=mgr))
    decode = SimpleNamespace(disagg_decode_prealloc_queue=SimpleNamespace(kv_manager=SimpleNamespace(request_status={7: 3})))
    plain = SimpleNamespace()
    got = {}
    for name, recv in (("prefill", prefill), ("decode", decode), ("plain", plain)):
        d = _digest.Digest({"probes": probes}, str(tmp_path / name), 1)
        (line,) = d.tick(1, recv)
        got[name] = json.loads(line)["v"]
    assert got["prefill"] == {"pd.prefill_kv_status.sum": 6, "pd.prefill_transfer_infos.len": 2, "pd.decode_kv_status.sum": None}
    assert got["decode"] == {"pd.prefill_kv_status.sum": None, "pd.prefill_transfer_infos.len": None, "pd.decode_kv_status.sum": 3}
    assert set(got["plain"].values()) == {None}
