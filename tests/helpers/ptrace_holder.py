"""Hold a process under ptrace, as strace or a debugger would: forks a sleeping Python child, PTRACE_SEIZEs it (the
child keeps running, but no second tracer, py-spy included, can attach), prints ``held <child pid>`` and exits
after ``HOLD_S`` seconds, which detaches it. Run it in a session of its own: the child shares its process group,
so ``os.killpg`` ends both. Linux only (ptrace through ctypes, as the parent of the tracee: allowed by every
``kernel.yama.ptrace_scope`` below 3).

    python ptrace_holder.py HOLD_S
"""

import ctypes
import os
import sys
import time

PTRACE_SEIZE = 0x4206  # <linux/ptrace.h>

hold_s = float(sys.argv[1])
child = os.fork()
if child == 0:
    time.sleep(600)
    os._exit(0)
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
if libc.ptrace(PTRACE_SEIZE, child, None, None) != 0:
    print(f"error: PTRACE_SEIZE failed: {os.strerror(ctypes.get_errno())}", flush=True)
    sys.exit(1)
print(f"held {child}", flush=True)
time.sleep(hold_s)
