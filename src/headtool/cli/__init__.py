"""The `headtool` command line: parses, calls the library, renders."""
from .app import app, main

__all__ = ["app", "main"]
