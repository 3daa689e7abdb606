"""The `jaxsample` command line."""

from jaxsample.cli.app import main

__all__ = ["main"]
