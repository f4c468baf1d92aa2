"""What keeps a long run safe, for every command: the folder lock (:mod:`.run_lock`), free-space checks
(:mod:`.disk_space`), world-size-independent work blocks (:mod:`.blocks`), stopping on SIGTERM/SIGUSR1 with the
preempted exit status (:mod:`.preemption`) and the fault-injection drills (:mod:`.drills`)."""
