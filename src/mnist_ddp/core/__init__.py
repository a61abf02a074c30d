"""The DDP program: the process group (`distributed`: join, `Dist`, teardown), the DDP wrap (`ddp`), the sharded
batches (`batches`), the training step (`steps`), BatchNorm's statistics across the ranks (`bnstats`), the
gradient reductions a run may choose (`reduction`), the exact evaluation (`evaluation`), the lr schedule and
optimizer (`schedule`), per-device settings (`compute`), the divergence guard (`divergence`), and the training
state (`state`).

With `trainer.py` (the loop) and `model.py` above it, this is what a reader of DDP reads: `distributed`, `ddp`,
`batches` and `steps` hold the six essential calls. It imports `common`, `joining` (at the join) and `model`; never
the outputs, recovery or the launchers."""
