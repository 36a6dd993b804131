"""Engine adapters: everything engine-specific (launch command, endpoints, process titles, sites) lives here.

``DEFAULT_ADAPTER`` is the engine a scenario runs when its ``[server] adapter`` names none (and the one
``repro demo`` shows); it is defined here, importing nothing, so that help texts can name the default engine's
example files without loading the registry."""

DEFAULT_ADAPTER = "sglang"
EXAMPLES_DIR = f"scenarios/{DEFAULT_ADAPTER}"  # where the default engine's scenarios, catalogue and rules live
