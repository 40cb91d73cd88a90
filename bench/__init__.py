"""fastrl benchmarks: the CLI (``python -m bench``, bench/README.md), every command's points on one harness
(``bench.session_run``). Importing this package imports nothing heavy."""
