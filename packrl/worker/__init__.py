"""The policy worker: model, reference, rollout engine, optimizer, contexts and checkpoint I/O of
one process (`policy.PolicyWorker`), its parallelism strategies (`strategy`: one process, FSDP2),
the actor's log-prob and update passes (`actor`) and checkpoint files (`checkpoint`)."""
