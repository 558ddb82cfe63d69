"""The Ray cluster as the manager meets it: joining it or starting the embedded instance, what
a pending job's resources wait for, this server's address in the GCS, Ray's own metrics."""
