"""A third engine for the engine seam's test (issue 30): everything the harness needs to know about it is in this
folder and in ``tests/fake_servers/third_engine_server.py``; it is added by registration alone
(``repro.targets.registry.register``), with no change to ``repro/``. See ``tests/test_third_engine.py``."""
