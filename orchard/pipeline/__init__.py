"""The end-to-end recipe on a CPU: tasks, a small model, expert trajectories, credit-assignment
SFT, BAR+GRPO, and evaluation on held-out tasks (``orchard pipeline``)."""
