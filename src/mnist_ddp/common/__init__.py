"""What every layer shares: the run's settings (`config`) and results as plain data, the one-sentence errors,
and the rules for what comes from outside (`untrusted`, `inputfile`), files replaced whole (`atomic`), signals held
during a save (`interrupts`), clocks (`timing`), the console's lines, optional packages (`extras`).

The bottom layer: it imports nothing else of mnist_ddp, and no torch at import (the CLI and the API read it first)."""
