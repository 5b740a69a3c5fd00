"""`python -m headtool` (also what `torchrun -m headtool` runs)."""
from .cli.app import main

main()
