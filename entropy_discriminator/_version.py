"""The package version, written once: pyproject.toml reads it (``[tool.setuptools.dynamic]``); CHANGELOG.md lists what each holds."""

__version__ = "0.2.0"
