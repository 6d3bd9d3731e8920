"""Calibration: measure a cluster and fit the cost model's parameters to it.

``measure.py`` times matmuls, copies and collectives on the live process
group; ``fit.py`` turns the timings into a ``HardwareProfile`` by least
squares; ``__main__.py`` is the command line.
"""
