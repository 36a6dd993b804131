"""A budget time-out says how far the burst got: a stall with live, in-step ranks (the HiCache io-aux fault under
``wait_complete``, docs/findings/hicache-io-aux-fault-stall.md) read only "rank(s) 0, 1 still use CPU" before, with
no word of the 4 of 8 requests that never came back (``repro.driver.DriverState.tally``, quoted by
``repro.run.session`` in the INCONCLUSIVE reason)."""

from repro.driver import DriverState


def _state(**kw) -> DriverState:
    base = dict(total=8, pending=0, outstanding=0, ok=8, failed=0, last_progress_t=None, finished=False)
    return DriverState(**{**base, **kw})


def test_a_stall_names_the_unanswered_requests_and_how_long_nothing_moved() -> None:
    st = _state(ok=4, outstanding=4, last_progress_t=1000.0)
    assert st.tally(1171.4) == "4 of 8 requests answered, 4 outstanding with no progress for 171 s"


def test_failed_and_unsent_requests_are_counted() -> None:
    st = _state(total=12, ok=5, failed=1, outstanding=2, pending=4, last_progress_t=10.0)
    assert st.tally(10.2) == "5 of 12 requests answered, 1 failed, 2 outstanding, 4 not sent yet"

