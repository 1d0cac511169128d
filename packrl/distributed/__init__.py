"""Worker groups: the protocol the training loop calls, and its in-process implementation."""
