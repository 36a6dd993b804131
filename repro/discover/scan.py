"""Entry script of the target-side scan for ``repro discover`` (the scanner itself: :mod:`repro.discover.astscan`).

Run in the TARGET interpreter as ``python scan.py`` (standard library only: it never imports ``repro`` nor the
engine): it puts its own folder first on ``sys.path``, imports the ``astscan`` package beside it and runs its
``main`` — one JSON request on stdin, one ``REPRO-DISCOVER {json}`` line on stdout.
"""

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from astscan.main import main

    main()
    # the answer is written; freeing the trees one by one at exit took longer than a parse pass
    sys.stdout.flush()
    os._exit(0)
