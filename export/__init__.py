"""Export trained proposers in the formats vLLM loads."""
