"""Models: what a MODEL reference names, its config and task class, loading, where it is placed,
its fingerprint and figures, and resizing attention to a new head geometry."""
