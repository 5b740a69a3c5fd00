"""`python -m headtool` (also what `torchrun -m headtool` runs)."""
from .cli import main

main()
