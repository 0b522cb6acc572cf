"""`python -m od_moe ...` is the `od-moe` command."""

from .cli import run

run()
