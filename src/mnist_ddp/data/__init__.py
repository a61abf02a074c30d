"""The data: MNIST-format datasets found, verified and downloaded (`datasets`, `download`, `idx`), the synthetic
digits made where no download is possible (`synthetic`), the cache every rank reads (`datacache`), and a user's own
image read as a digit (`images`).

It imports only `common`: the DDP program (`core`) is given tensors and never asks where they came from."""
