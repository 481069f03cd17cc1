"""The old import path of engine.cpu.alloc (public: users and tests import it), the same module object, so a
patch through either name reaches the other."""

import sys

from engine.cpu import alloc

sys.modules[__name__] = alloc
