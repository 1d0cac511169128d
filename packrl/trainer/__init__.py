"""The controller: the training loop (one RL step top to bottom), the advantage stage, the run
directory and validation."""
