"""Bad input, fuzzed with hypothesis: every case ends in a clear ComposerError (or
exit code 2 and one line from the CLI) and writes nothing. The session prints how
many cases each suite tried (tests/fuzz/conftest.py)."""
