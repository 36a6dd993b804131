"""Engine adapters: everything engine-specific (launch command, endpoints, process titles, sites) lives here.

``DEFAULT_ADAPTER`` is the engine a scenario runs when its ``[server] adapter`` names none (and the one
``repro demo`` shows); it is defined here, importing nothing, so that help texts can name the default engine's
example files (``repro.resources.EXAMPLES_DIR``) without loading the registry."""

DEFAULT_ADAPTER = "sglang"
