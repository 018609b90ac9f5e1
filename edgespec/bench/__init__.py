"""Benchmark helpers: timed decoding runs that compare configurations side by side."""
from .runner import RunResult, PeakRSS, timed_decode

__all__ = ["RunResult", "PeakRSS", "timed_decode"]
