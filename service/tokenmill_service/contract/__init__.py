"""What the server and the worker processes both import: flags, messages, requests, the plan's
values, grammars, the tokenizer and the chat formats. Never imports torch."""
