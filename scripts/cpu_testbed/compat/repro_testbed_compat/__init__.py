"""HiCache CPU compatibility layer (placeholder until the layer lands): install() does nothing yet."""


def install() -> None:
    """Register the lazy patches (none yet)."""
