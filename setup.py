"""Packaging that pyproject.toml cannot express: the top-level sql/ and notebooks/
directories ship inside the package as data packages, with no code in them."""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

#: Data packages: the import name the package finds them by, and the directory they are built from.
DATA_PACKAGES = {"composer_ops.migrations": "sql", "composer_ops.notebooks": "notebooks"}


class BuildPy(build_py):
    """A data package's only module is its ``__init__.py`` (which makes it importable
    from a source checkout too); notebooks/conftest.py belongs to the test suite."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        modules: list[tuple[str, str, str]] = super().find_package_modules(package, package_dir)
        if package in DATA_PACKAGES:
            return [m for m in modules if m[1] == "__init__"]
        return modules


setup(
    packages=[*find_packages(include=["composer_ops", "composer_ops.*"]), *DATA_PACKAGES],
    package_dir=DATA_PACKAGES,
    # "": named SQL kept in .sql files beside the module that loads them, in any package.
    package_data={"": ["*.sql"], "composer_ops": ["py.typed"],
                  "composer_ops.migrations": ["V*.sql", "R__*.sql", "citus/V*.sql", "citus/R__*.sql"],
                  "composer_ops.notebooks": ["*.ipynb", "runbooks/*.ipynb"]},
    cmdclass={"build_py": BuildPy},
)
