"""The version of ppokit (recorded in every checkpoint)."""

__version__ = "0.1.0"
