"""Old name of SGLang's CPU testbed module, now ``repro.targets.sglang.testbed`` (kept for the tests, scripts and
benchmarks that import ``repro.testbed``): importing it gives that very module, so monkeypatching either name patches
both."""

import sys

from repro.targets.sglang import testbed as _testbed

sys.modules[__name__] = _testbed
