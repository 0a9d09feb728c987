"""GPU benchmarks and checks (kernels, engines, runtime), run on the lent H200; not imported by the library.

Each module is a `python -m g4rt.bench.<name>` entry point that writes JSON lines under `--out`; the
committed results with their commands live in plugins/results, export/results and runtime/results.
"""
