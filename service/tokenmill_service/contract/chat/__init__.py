"""The chat formats: chat templates, gpt-oss's harmony, tool calls."""
