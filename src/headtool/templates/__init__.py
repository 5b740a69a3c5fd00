"""Files that headtool copies into output folders (self-contained: they never import headtool)."""
