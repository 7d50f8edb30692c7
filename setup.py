"""Package discovery for the five source roots (core/, plugins/, engines/, apps/, integrations/) under one name."""

from setuptools import find_packages, setup

ROOTS = {"polyaccel": "core", "polyaccel.plugins": "plugins", "polyaccel.engines": "engines", "polyaccel.apps": "apps",
         "polyaccel.integrations": "integrations"}
packages = []
for pkg, root in ROOTS.items():
    packages.append(pkg)
    packages += [f"{pkg}.{sub}" for sub in find_packages(root)]

setup(packages=packages, package_dir=ROOTS)
