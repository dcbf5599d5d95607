"""Package discovery (pyproject.toml holds everything else).

One import namespace: ``lazyrag/`` and every package under it (the kernels among them, as
``lazyrag.kernels``), plus the design card's top-level ``integrations/`` folder installed as
``lazyrag.integrations`` (never as a generic top-level name). Packages are found, not listed,
so a new subpackage cannot be left out of the wheel.
"""
from setuptools import find_namespace_packages, find_packages, setup

MOUNTED = {"lazyrag.integrations": "integrations"}

# namespace packages too: lazyrag/data/ and the folders under it hold only package data (adapters, eval samples),
# and setuptools warns about every importable folder the packages do not list
packages = find_namespace_packages(include=["lazyrag", "lazyrag.*"], exclude=["*.__pycache__", "*.__pycache__.*"])
package_dir = {"lazyrag": "lazyrag"}
for name, folder in MOUNTED.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    package_dir[name] = folder

setup(packages=packages, package_dir=package_dir)
