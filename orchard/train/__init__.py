"""Training recipes: GRPO objective, BAR sampling, credit-assignment SFT (torch)."""
