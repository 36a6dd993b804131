"""Issue 29 item 0: a blank line between two threads of one py-spy dump must not start a second rank."""

from repro.readers import parse_dump

ONE_PROCESS_WITH_BLANK = """Process 4242: python -m sglang.launch_server --tp 2
Python v3.11.9 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    all_reduce (sglang/srt/distributed/parallel_state.py:420)
    event_loop_normal (sglang/srt/managers/scheduler.py:900)

Thread 4300 (idle): "Thread-1"
    all_reduce (sglang/srt/distributed/parallel_state.py:420)
    wait (threading.py:320)
"""


def test_blank_line_inside_one_pyspy_process_is_one_rank():
    dumps = parse_dump(ONE_PROCESS_WITH_BLANK, "oneproc_blank.txt")
    assert len(dumps) == 1, [d.pid for d in dumps]
    assert dumps[0].pid == 4242
    assert len(dumps[0].threads) == 2
