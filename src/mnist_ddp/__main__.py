"""`python -m mnist_ddp …` (what torchrun runs with `-m mnist_ddp`)."""

from .cli import console

if __name__ == "__main__":
    console()
