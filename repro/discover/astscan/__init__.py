"""Target-side scan for ``repro discover`` (a package run by the entry script ``repro/discover/scan.py``): find
rank-local decision points around collectives in an engine's source.

Runs in the TARGET interpreter (the one that runs the server) as a plain script, with the standard library only: it
never imports ``repro`` nor the engine's modules (it only locates the package with ``importlib.util.find_spec``
and reads its ``.py`` files with ``ast``). Request: one JSON object on stdin (the adapter's rules, see
``scenarios/sglang/discover_rules.toml``); answer: one line ``REPRO-DISCOVER {json}`` on stdout.

What it computes (all from the AST, nothing executed):

1. **Collective-reaching functions**: a call graph over the package, resolving plain names and imports, module
   attributes, ``self.method`` (the class's MRO, plus overrides in subclasses: a call on a declared class may land
   in any subclass), ``super().method`` and ``x.method`` where the class of ``x`` is known (constructor calls,
   annotations of parameters/attributes/returns, ``self.attr = …`` in any method, keyword arguments of a class's
   constructor calls, the classes call sites pass into a function's parameters, what an unannotated function
   returns, a class a factory hands out: ``self.get_prefill_adder_class()(…)``); reading a ``@property`` is a call
   to its getter. Seeds: ``torch.distributed`` collectives, the coordinator's collective methods, object
   broadcasts. Calls that resolve to nothing in the package are listed (``unresolved``), never guessed.
2. **Guards**, per function that calls a collective-reaching function: a may-taint analysis over its statements
   (through local assignments, attribute paths such as ``batch.is_full``, and implicit flows: an assignment made
   under a tainted condition is tainted) from **rank-local sources** (pool/allocator queries matched by name,
   clocks, non-blocking polls, attributes written inside a ``Thread`` target, ``len()`` of those, ``except``
   paths, and calls of functions — or reads of properties — whose returned value depends on one: ``returners``,
   each with its innermost queries, the *leaves*, to perturb where they are read) to a branch, loop bound,
   ``break``, ``continue`` or ``return`` that changes whether, or how many times, a collective-reaching call runs
   in the same invocation — a ``break`` counts every later iteration of its loop.
   **Across calls** (issue 31): an attribute of ``self`` (or of an object reachable from it) written from a rank-local
   value in one method is a source where another method reads it (``cross-call attribute``: its leaves are the
   writes' queries); an emptiness or membership test on a per-rank container (``not self.ongoing_x``,
   ``k in self.ongoing_x``: a name the rules list, or one holding such values) is a source whose leaves are the
   methods adding to it (``container write``, at each caller); a callable stored on ``self`` (a bound method, a
   function, a ``partial``, a ``lambda``) is followed as a call.
   **Sanitizers**: results of collectives and of collective-reaching calls that return no rank-local value of
   their own (every rank agrees on them), the
   attributes named as derived from the request broadcast (e.g. the waiting queue), and the tensor an in-place
   collective reduced.

Mirrors no sglang function; written against sglang 0.5.23's layout (``sglang.srt``), but every engine name comes
from the request.

By role: :mod:`.package` (what to scan), :mod:`.index` (modules, functions, classes), :mod:`.walk` (cached walks and
matching), :mod:`.infer` (which class a value is), :mod:`.reach` (the call graph), :mod:`.attrs` (attribute writes),
:mod:`.guards` (one function's taint analysis), :mod:`.sources` (sources across calls), :mod:`.main` (one scan).
The modules import each other relatively: the package runs as ``astscan`` in the target interpreter (the entry script
puts ``repro/discover/`` first on ``sys.path``) and as ``repro.discover.astscan`` in the harness.
"""

MARK = "REPRO-DISCOVER "
COLL = "<collective>"
MAX_LEAVES = 96  # innermost queries kept per derived source (a getter over a wide class hierarchy names many)
