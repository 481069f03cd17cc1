"""The old import path of engine.cpu.block_pool (public: users and tests import it), the same module object, so a
patch through either name reaches the other."""

import sys

from engine.cpu import block_pool

sys.modules[__name__] = block_pool
