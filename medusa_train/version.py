"""The package version, read by the package and written into every export's config.json."""

__version__ = "0.1.0"
