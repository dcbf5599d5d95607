"""The package version, in one place (pyproject.toml reads it; CHANGELOG.md says what each version changed)."""

__version__ = "0.2.0"
