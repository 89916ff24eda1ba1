"""The bottom layer: errors, the integer ranges of the wire and the engine timing model.

Imports nothing of the package: every other layer may use it.
"""
