"""MANY attempts: the elastic policy, the one ElasticRun loop, start, resume, stragglers and re-planning."""
