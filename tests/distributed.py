"""The tests' multi-process launcher is the library's (one process group per test module)."""

from boost_hf.perf.launcher import launch

__all__ = ["launch"]
