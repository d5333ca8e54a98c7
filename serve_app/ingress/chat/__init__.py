"""OpenAI Chat Completions: wire request → IR, events → chunks / completion."""
