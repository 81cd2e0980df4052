"""The package version, importable without importing the library."""

__version__ = "0.1.0"
