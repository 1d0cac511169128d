"""packrl: RL post-training for LLMs in which sequence length is a budgeted resource."""

__version__ = "0.1.0"
