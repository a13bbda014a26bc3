"""Tool-call formats, one module per kind of format (tool_parsers.py holds the registry of vLLM's names):
JSON calls (hermes, llama3_json, mistral, granite), Python calls (pythonic), tags per argument (qwen3_coder,
glm45), sections in special tokens (deepseek_v3, deepseek_v31, kimi_k2) and harmony messages (openai, gpt-oss).
`base.ToolParser` is the interface."""
