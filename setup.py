"""Builds the conductor's C extensions, its KV index's table and the policies' pool scan (everything
else is in pyproject.toml).

``pip install -e .`` compiles them in place; there is no pure-Python fallback, so a missing
compiler fails the install rather than leaving a slow conductor behind."""

from setuptools import Extension, setup

FLAGS = ["-O3", "-std=c11", "-Wall", "-Werror=implicit-function-declaration"]
"""No -ffast-math: the scan's sums must be IEEE doubles in source order (bit-equal to Python)."""

setup(ext_modules=[
    Extension("conductor._kvtable", ["conductor/_kvtable.c"], extra_compile_args=FLAGS),
    Extension("conductor._scan", ["conductor/_scan.c"], extra_compile_args=FLAGS),
])
