"""The package version, in one place (the package, the command line and the metadata read it)."""

__version__ = "0.3.0"
