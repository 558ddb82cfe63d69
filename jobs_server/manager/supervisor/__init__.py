"""What runs inside a supervisor actor, on any node: the actor, each job's attempts and run, the
fork server and its zygote, the job's processes and their containment, the guardian and the log
spool. It imports only the standard library, Ray, pydantic and psutil (and the manager's records,
store and logs), never the server's side: tests/test_architecture.py checks it."""
