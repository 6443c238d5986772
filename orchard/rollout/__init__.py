"""Agent rollouts on sandboxes: policies, the multi-turn loop, grading, batches."""
