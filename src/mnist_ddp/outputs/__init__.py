"""What a run writes and what reads it back: checkpoints (`checkpoint`: atomic, digested, loaded safely) and the run's
save and resume (`saving`), model.safetensors (`model_file`), the console lines, metrics and plots (`report`,
`summary`), `--profile`'s timeline, TensorBoard and MLflow (`tb`, `tracking`), the run folder (`outdir`), and the
commands over a saved model (`infer`: evaluate and predict; `export`: ONNX).

It imports `common`, `data`, `core` and `model`; the loop calls it, mostly on rank 0."""
