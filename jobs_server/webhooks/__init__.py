"""Webhooks (issue 36): which targets a job's events go to, the policy on their addresses, the
Standard Webhooks signatures, and the worker that sends the archive's outbox. The manager never
imports this package: the archive writes deliveries through the planner it is given."""
