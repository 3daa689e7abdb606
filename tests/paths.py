"""Where the tests' files are: the repository root, tests/data and the tiny GGUF.

Imported as `paths` (tests/ is on sys.path, as for `helpers` and `ties`); it
imports nothing heavy, so JAX-free tests can use it.
"""

from __future__ import annotations

import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA = TESTS / "data"
TINY_GGUF = str(DATA / "tiny_llama.gguf")
