"""The job history: the archive (one interface, `interface.JobArchive`, with two stores: SQLite
on the head's disk, the default, and PostgreSQL at `--database-url`), its queries, group commit,
new rows, the numbered job events and their live feed, the counts by status, and retention."""
