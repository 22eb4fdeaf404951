"""Training on several processes."""
