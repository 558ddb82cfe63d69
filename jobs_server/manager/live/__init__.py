"""Live jobs: their records in Ray's GCS KV (where the server and the supervisors coordinate),
one watcher per live job, what a run's end means, what a starting server reconciles, and what
the server learns of a run on its way to the archive."""
