"""The training loop, the actor's update, batch building and checkpoints."""
