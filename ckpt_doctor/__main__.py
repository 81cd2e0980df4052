"""`python -m ckpt_doctor`."""

from .cli import main

main()
