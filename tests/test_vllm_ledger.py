"""The ledger alignment (repro/ledger.py ``align``) compares call sites and injected marks, not only op and size:
vLLM's CPU shm communicator pairs an extra op with the peer's next op of the same kind and size, so an injected
all_reduce completes against a genuine one and the ranks drift out of step silently; the first divergence must be
named at the injected record, not where the drift ran out (docs/vllm.md)."""

from __future__ import annotations

from repro.ledger import GroupInfo, RankLedger, Record, align

DEV = GroupInfo(key="2", ranks=(0, 1), backend="gloo", label="tp:0/device")
EMB = ("vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding.forward",
       "vllm.model_executor.models.llama:LlamaModel.embed_input_ids")
ROW = ("vllm.model_executor.layers.linear:RowParallelLinear.forward", "vllm.model_executor.models.llama:LlamaMLP.forward")
LOGITS = ("vllm.model_executor.layers.logits_processor:LogitsProcessor._gather_logits",)
INJ_SITE = ("vllm.model_executor.layers.linear:RowParallelLinear.forward",)


def rec(rank, seq, op, site, *, shapes=((16, 128),), inj=None, open_=False) -> Record:
    t = seq * 1.0 + rank * 0.01
    return Record(rank=rank, group="2", seq=seq, op=op, red="SUM" if op == "all_reduce" else None, shapes=shapes,
                  dtypes=("float32",), site=site, tick=1, t_enter=t, t_exit=None if open_ else t + 0.001, inj=inj,
                  api="GroupCoordinator." + op)


def led(rank, recs) -> RankLedger:
    return RankLedger(rank=rank, pid=100 + rank, groups={"2": DEV}, records=list(recs), dropped=0, max_records=100)


def step(rank, start):
    """One forward: embedding all_reduce, two row-parallel all_reduces, the logits all_gather."""
    return [rec(rank, start, "all_reduce", EMB), rec(rank, start + 1, "all_reduce", ROW),
            rec(rank, start + 2, "all_reduce", ROW), rec(rank, start + 3, "all_gather", LOGITS, shapes=((16, 512),))]


def test_an_injected_op_paired_with_the_peers_genuine_one_is_the_first_divergence():
    r0 = step(0, 1) + [rec(0, 5, "all_reduce", INJ_SITE, inj="extra_shm_allreduce")] + [
        rec(0, 6, "all_reduce", EMB), rec(0, 7, "all_reduce", ROW), rec(0, 8, "all_reduce", ROW),
        rec(0, 9, "all_gather", LOGITS, shapes=((16, 512),), open_=True)]
    # rank 1's embedding all_reduce #5 completed against rank 0's injected one, and each later op against rank 0's
    # op one step behind; rank 0 ends in the logits all_gather #9 that rank 1 never issues (it idles)
    r1 = step(1, 1) + [rec(1, 5, "all_reduce", EMB), rec(1, 6, "all_reduce", ROW), rec(1, 7, "all_reduce", ROW),
                       rec(1, 8, "all_reduce", ROW)]
    d = align({0: led(0, r0), 1: led(1, r1)})
    assert d.kind == "mismatch" and d.seq == 5 and d.group.label == "tp:0/device"
    assert d.culprits == (0,) and "injected" in d.fields
    assert d.entered[0].inj == "extra_shm_allreduce" and d.entered[1].inj is None
    assert d.summary.startswith("TP device group #5: rank 0 entered the injected all_reduce #5")
    assert "rank 1 entered all_reduce #5" in d.summary and "VocabParallelEmbedding.forward" in d.summary


def test_same_ops_from_the_same_call_sites_agree():
    d = align({0: led(0, step(0, 1) + step(0, 5)), 1: led(1, step(1, 1) + step(1, 5))})
    assert d.kind == "none"


def test_a_call_site_mismatch_without_injection_names_the_odd_rank_of_three():
    g3 = GroupInfo(key="2", ranks=(0, 1, 2), backend="gloo", label="tp:0/device")
    recs = {r: step(r, 1) for r in range(3)}
    recs[2][1] = rec(2, 2, "all_reduce", EMB)  # rank 2 issued its #2 from the embedding (a drifted rank)
    leds = {r: RankLedger(rank=r, pid=100 + r, groups={"2": g3}, records=v, dropped=0, max_records=100)
            for r, v in recs.items()}
    d = align(leds)
    assert d.kind == "mismatch" and d.seq == 2 and d.fields == ("call site",) and d.culprits == (2,)
