"""`--recover`: survivors of a lost rank agree through the store and re-form the process group in place (`recovery`),
from the in-memory copy of each step's starting state (`snapshot`), handing each other what the lost rank held
(`regroup`); on several nodes, the standby store that takes over when node 0's launcher is lost (`successor`); and
the losses tests plant at exact points of the loop (`lossplan`).

An extension: `extended.ExtendedTrainer` calls it at step and fold boundaries and when an epoch fails; a run
without `--recover` never enters it, and the textbook loop (`trainer`) never imports it. It imports `common`,
`joining`, `core` and `outputs`."""
