"""``python -m repro`` = the ``repro`` console script."""

from repro.cli import main

main()
