"""Whole jobs built from the layers below: recipes (their schema and their runner)."""
