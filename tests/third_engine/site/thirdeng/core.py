"""The third engine's scheduler: ``Engine.step`` runs once per tick in every rank process (the injection site and
the tick function of ``tests/third_engine/adapter.py``)."""


class Engine:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.ticks = 0

    def step(self) -> int:
        self.ticks += 1
        return self.ticks
