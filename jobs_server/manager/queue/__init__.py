"""The queue: its admission rules (caps, tenants' turns, priorities; plain logic), the
dispatcher that hands queued jobs over as slots free, and the retry rules of a failed attempt."""
