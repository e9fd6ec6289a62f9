"""OpenAI's Responses API, served through the chat completions path."""
