"""What ships to a node: stdlib only (plus hetctl.errors and hetctl.vendors), packed into the agent zipapp."""
