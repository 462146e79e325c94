"""`transformers`, imported without its import-time advice.

degs_jax uses transformers for tokenizers only and never imports torch. On an install
without torch (the default: torch is only the tests' parity reference), importing
transformers logs "PyTorch was not found. Models won't be available ..." on stderr, which
a newcomer reads as a failure although nothing degs_jax does needs torch. The notice is
one of transformers' *advisory* warnings (`logger.warning_advice`), which it skips while
the environment sets `TRANSFORMERS_NO_ADVISORY_WARNINGS`; `transformers()` sets that
variable only around the first import and restores it after, so warnings and errors
logged later (loading a tokenizer, the caller's own use of transformers) are untouched.
"""

from __future__ import annotations

import importlib
import os
import sys

ADVISORY_SWITCH = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def transformers():
    """The `transformers` module (imported on first call, without its advisory notices)."""
    if "transformers" in sys.modules:
        return sys.modules["transformers"]
    before = os.environ.get(ADVISORY_SWITCH)
    os.environ[ADVISORY_SWITCH] = "1"
    try:
        return importlib.import_module("transformers")
    finally:
        if before is None:
            os.environ.pop(ADVISORY_SWITCH, None)
        else:
            os.environ[ADVISORY_SWITCH] = before
