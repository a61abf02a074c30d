"""Starting the training processes: `-n/-g/-nr`'s children forked from a server that imported torch once
(`forkserver`), or the rank read from torchrun, MPI or SLURM (`launch`); per rank, `worker.run_worker` joins the
process group, trains (the data, the loop) and leaves it (`worker`).

The top of the program below the CLI and the API: it imports every layer beneath, and the loop (`trainer`,
`extended`)."""
