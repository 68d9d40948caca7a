"""A run's numbers: what each metric is (values), where records go (sinks), and the experiment trackers."""
