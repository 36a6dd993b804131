"""Stack-dump records and parsers (kept for callers; the readers live in :mod:`repro.readers`).

Re-exports the records (:class:`Frame`, :class:`ThreadStack`, :class:`ProcessDump`, :class:`RankCapture`) and
the parsing entry points (:func:`parse_dump`, :func:`load_dump_file`, :func:`parse_pyspy_text`,
:func:`parse_pyspy_json`, :func:`parse_faulthandler`, :func:`detect_format`, …). See :mod:`repro.readers` for the
formats read.
"""

from __future__ import annotations

from repro.readers import (  # noqa: F401
    FORMAT_NAMES,
    CaptureMethod,
    DumpFormat,
    Frame,
    ProcessDump,
    RankCapture,
    ThreadStack,
    detect_format,
    guess_main,
    is_binary,
    is_native_file,
    load_dump_file,
    parse_dump,
    parse_faulthandler,
    parse_lines,
    parse_pyspy_json,
    parse_pyspy_text,
    pp_from_title,
    rank_from_filename,
    rank_from_title,
    render_pyspy_text,
    shorten_path,
    split_log_prefixes,
)
from repro.readers.common import NO_STACK_HINT as _NO_STACK_HINT  # noqa: F401
