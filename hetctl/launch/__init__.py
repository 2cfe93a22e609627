"""ONE attempt of a run: materialize the plan into commands, start the agents, watch them, stop them."""
