"""Packages by discovery (metadata and data files: pyproject.toml).

Every folder with an __init__.py under autofuse/ is a package of the wheel, and so is kernels/ with
its subfolders, shipped as autofuse.kernels: a new folder is in the wheel without anyone listing it.
pyproject.toml alone cannot say this: its find cannot install one folder under another's name.
"""
from setuptools import find_packages, setup

KERNELS = "autofuse.kernels"  # kernels/ at the top level, imported as autofuse.kernels

setup(packages=[*find_packages(include=["autofuse", "autofuse.*"]), KERNELS,
                *(f"{KERNELS}.{p}" for p in find_packages("kernels"))],
      package_dir={KERNELS: "kernels"})
