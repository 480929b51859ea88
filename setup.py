"""Builds the C extension of the conductor's KV index (everything else is in pyproject.toml).

``pip install -e .`` compiles it in place; there is no pure-Python fallback, so a missing
compiler fails the install rather than leaving a slow index behind."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("conductor._kvtable", ["conductor/_kvtable.c"],
              extra_compile_args=["-O3", "-std=c11", "-Wall", "-Werror=implicit-function-declaration"]),
])
