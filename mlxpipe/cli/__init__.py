"""The command line: arguments (:mod:`.options`, documented by :mod:`.docs`), the input files
(:mod:`.inputs`), rendering (:mod:`.render`), stderr on a terminal (:mod:`.term`), signals (:mod:`.signals`),
and :func:`main`, which ties them together and maps errors to exit codes (:mod:`.main`).
"""

from .main import main

__all__ = ["main"]
