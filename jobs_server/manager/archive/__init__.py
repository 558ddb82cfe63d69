"""The job history on the head's disk: the archive (SQLite today; a PostgreSQL store for several
replicas will sit beside it), its queries, group commit, new rows, the numbered job events and
their live feed, the counts by status, and retention."""
