"""The CUDA-graph step: the textbook DDP step captured once per batch shape and replayed (`graphstep`), with the
optimizer's update on flat buffers that a graph can hold (`flatopt`). On the CPU the same code runs eagerly, which is
how the tests prove what a replay does.

An extension a reader of DDP can skip (docs/design/graph-step.md): `extended.ExtendedTrainer` picks it where a run
allows it. It imports `core` and `common`."""
