"""Build hook only (metadata lives in pyproject.toml): ship the injector, the scenarios and the CPU testbed files.

They stay at the top of the clone (``injectors/``, ``scenarios/``, ``scripts/cpu_testbed/``); ``build_py`` copies
them into the wheel as ``repro/_data/<name>/`` (plain copies: symlinks are not followed reliably by setuptools), and
``repro/resources.py`` finds them in either layout. Editable installs skip the copy: they read the clone directly.
The table of folders is ``DATA_FOLDERS`` in repro/resources.py (read from the file, without importing ``repro``).
"""

import ast
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo", ".pytest_cache")


def data_folders() -> dict:
    """``DATA_FOLDERS`` from repro/resources.py: name in repro/_data -> folder of the clone."""
    tree = ast.parse((HERE / "repro" / "resources.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "DATA_FOLDERS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError("repro/resources.py defines no DATA_FOLDERS table")


class BuildPyWithData(build_py):
    """``build_py`` that also copies the data folders into ``<build_lib>/repro/_data``."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dest_root = Path(self.build_lib) / "repro" / "_data"
        shutil.rmtree(dest_root, ignore_errors=True)  # no stale files from an earlier build
        for name, src in data_folders().items():
            src_dir = HERE / src
            if not src_dir.is_dir():
                raise RuntimeError(f"{src_dir}: data folder missing (sdist without MANIFEST.in's grafts?)")
            shutil.copytree(src_dir, dest_root / name, symlinks=False, ignore=IGNORE)


setup(cmdclass={"build_py": BuildPyWithData})
