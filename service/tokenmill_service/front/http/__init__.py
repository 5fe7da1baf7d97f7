"""The HTTP APIs (OpenAI's, Anthropic's Messages, OpenAI's Responses), their JSON schemas, OpenAPI."""
