"""The api process: OpenAI-compatible and native HTTP routes over a `TokenizerManager`."""
