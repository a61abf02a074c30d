"""`python -m mnist_ddp …` (what torchrun runs with `-m mnist_ddp`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
