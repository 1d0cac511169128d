"""The controller and its recipes: the RL training loop (`loop`, one step top to bottom), its
sampling stages (`stages`, one per ``trainer.rollout_mode``), the advantage stage (`batch`), the
run directory and its logs (`run`), validation (`validate`), resume (`resume`), automatic recovery
(`recovery`) and the supervised recipe `packrl sft` (`sft`)."""
