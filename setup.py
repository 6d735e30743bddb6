"""A shim for tools that still run setup.py: the package is defined in pyproject.toml (PEP 621)."""
from setuptools import setup

setup()
