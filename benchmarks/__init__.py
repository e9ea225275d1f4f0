"""Benchmarks: each ``benchmarks/<name>.py`` is a command (see benchmarks/README.md). A package so
that ``benchmarks.overhead`` imports the same way from the command and from the unit tests."""
