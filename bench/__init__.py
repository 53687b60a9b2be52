"""Benchmarks that print side-by-side ratios (README.md, section Performance).

Each `bench.bN_*` module measures one claim against a plain baseline and writes
`<out>/<id>.json`; `python -m bench.run_all` runs them all and `python -m bench.render` turns the
results into the README table. Nothing runs at import time.
"""
