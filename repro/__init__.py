"""tp-deadlock-repro: make tensor-parallel collective-desync deadlocks deterministic, capture and explain them.

Roles (Jepsen words in brackets): ``scenario`` [test as data], ``injectors/`` [nemesis], ``driver`` [client],
``capture`` + ``stacks`` + ``analysis`` + ``verdict`` [checker], ``evidence`` [store]. ``targets/`` holds one
adapter per engine (SGLang today). The harness process never imports the engine.
"""

__version__ = "0.1.0"
