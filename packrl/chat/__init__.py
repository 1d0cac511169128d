"""Chat rendering that the data and the rollouts share: the tool messages a chat template puts
around an assistant turn (`render.ToolRenderer`) and the tools' JSON schemas every render of a run
passes to the template (`tool_schemas`). Below `data` and `rollout` in the layers, so prompts,
SFT traces and multi-turn rollouts render a conversation token for token alike."""
