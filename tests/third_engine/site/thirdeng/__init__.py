"""The third engine's package (tests only): its version and its scheduler (``core``)."""

__version__ = "7.1.0"
