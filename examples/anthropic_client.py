"""The `anthropic` SDK's Messages API against `paged-hf serve`: plain, streamed, and a tool round trip.

    paged-hf serve &                       # the default model, SmolLM2-135M-Instruct, on 127.0.0.1:8000
    python examples/anthropic_client.py [--base-url http://127.0.0.1:8000] [--model NAME]

Claude Code and other Anthropic clients work the same way: point ANTHROPIC_BASE_URL at the server. Recent
SDKs have no `temperature` argument; it goes in `extra_body` (the server honours it).
"""

from __future__ import annotations

import argparse
import json

from anthropic import Anthropic

WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "additionalProperties": False, "required": ["city"],
                            "properties": {"city": {"type": "string", "maxLength": 30}}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="served model name")
    args = parser.parse_args()
    client = Anthropic(base_url=args.base_url, api_key=args.api_key)
    greedy = {"model": args.model, "max_tokens": 60, "extra_body": {"temperature": 0}}

    reply = client.messages.create(system="Answer in one sentence.", **greedy,
                                   messages=[{"role": "user", "content": "What is the capital of France?"}])
    print("plain:   ", reply.content[0].text, f"({reply.stop_reason})")

    print("streamed: ", end="")
    with client.messages.stream(messages=[{"role": "user", "content": "Name three colors."}], **greedy) as stream:
        for text in stream.text_stream:
            print(text, end="", flush=True)
    print()

    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    call_turn = client.messages.create(messages=question, tools=[WEATHER], tool_choice={"type": "any"}, **greedy)
    use = next(block for block in call_turn.content if block.type == "tool_use")
    print("tool use:", use.name, use.input)
    result = {"city": use.input.get("city"), "sky": "sunny", "celsius": 21}
    final = client.messages.create(tools=[WEATHER], **greedy, messages=[
        *question, {"role": "assistant", "content": call_turn.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": json.dumps(result)}]}])
    print("answer:  ", final.content[0].text if final.content else "", f"({final.stop_reason})")


if __name__ == "__main__":
    main()
