"""Where processes meet and who may join: who this process is (`identity`, from any launcher's variables),
node 0's rendezvous store (`rendezvous`), the check-in that proves a process belongs to the job (`membership`), the
beats that name a rank which stopped answering (`heartbeat`), and the admission that runs both around the join
(`admission`).

Every run passes through it once, at the join (`distributed.join`); a reader of the DDP program can skip it.
It imports only `common`."""
