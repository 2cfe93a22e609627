"""The files between the commands: one pydantic model per file (inventory, cluster, plan, run, events)."""
