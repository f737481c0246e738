"""The package list, derived: every package under freqopt/ (setuptools.find_packages), and search_spaces/ (the GPU and
host files, at the top of the repository as the design card lays it out) shipped inside the wheel as
freqopt.search_spaces, so that an installed freqopt finds them too (freqopt.gpu.search_spaces.search_spaces_dir).
Everything else about the project is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["freqopt", "freqopt.*"]), "freqopt.search_spaces"],
    package_dir={"freqopt.search_spaces": "search_spaces"},
    package_data={"freqopt.search_spaces": ["*.toml", "hosts/*.toml"]},
)
