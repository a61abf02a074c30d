"""Imported by the fork server alone, after its other imports (forkserver.PRELOAD): SIGINT is blocked there, so
every child it forks holds a Ctrl-C until launch._spawned can unwind it (forkserver.release_interrupts); one that
came during multiprocessing's own start of the child would end it with exit code 1, saying nothing."""

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
