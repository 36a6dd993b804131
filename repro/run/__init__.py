"""One run, end to end, by role (docs/pipeline.md): scenario → plan → server → arm → burst → stall? → capture ×2 → verdict → evidence.

The runner wires the roles together and owns the life-cycle: the server tree is torn down on every outcome,
on Ctrl-C and on SIGTERM (the CLI turns SIGTERM into ``KeyboardInterrupt``), and the evidence folder is kept and
marked ``interrupted`` when the run does not finish. It renders nothing: progress goes to an optional observer.

:mod:`.options` (what a run is asked and produces), :mod:`.prepare` (inputs, sites, folder, plan: nothing
launched), :mod:`.arm` (the arm file and its acknowledgement), :mod:`.records` (what the injector recorded),
:mod:`.session` (one server's life-cycle), :mod:`.finish` (the run folder, written once), :mod:`.loop` (the one
loop: one variant or several on one server). ``repro.runner`` re-exports them all.
"""
