"""The version of hybridd (the package, the CLI, the supervisor's status)."""

__version__ = "0.1.0"
