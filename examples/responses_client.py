"""The `openai` SDK's Responses API against `paged-hf serve`: plain, streamed, and a tool round trip.

    paged-hf serve &                       # the default model, SmolLM2-135M-Instruct, on 127.0.0.1:8000
    python examples/responses_client.py [--base-url http://127.0.0.1:8000/v1] [--model NAME]

The tool turn uses `tool_choice="required"` (enforced by a grammar, so even a small model writes a valid
call); the tool's output goes back with `previous_response_id`, so the server recalls the conversation.
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 30}}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    parser.add_argument("--model", default=None, help="served model name (default: the server's first)")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id

    reply = client.responses.create(model=model, instructions="Answer in one sentence.", temperature=0,
                                    input="What is the capital of France?", max_output_tokens=40)
    print("plain:   ", reply.output_text)

    print("streamed: ", end="")
    for event in client.responses.create(model=model, input="Name three colors.", temperature=0,
                                         max_output_tokens=40, stream=True):
        if event.type == "response.output_text.delta":
            print(event.delta, end="", flush=True)
    print()

    call_turn = client.responses.create(model=model, input="What is the weather in Paris?", tools=[WEATHER],
                                        tool_choice="required", temperature=0, max_output_tokens=60)
    call = next(item for item in call_turn.output if item.type == "function_call")
    print("tool call:", call.name, call.arguments)
    result = {"city": json.loads(call.arguments).get("city"), "sky": "sunny", "celsius": 21}
    final = client.responses.create(model=model, previous_response_id=call_turn.id, tools=[WEATHER],
                                    temperature=0, max_output_tokens=60,
                                    input=[{"type": "function_call_output", "call_id": call.call_id,
                                            "output": json.dumps(result)}])
    print("answer:  ", final.output_text)
    print("stored:  ", client.responses.retrieve(final.id).status)


if __name__ == "__main__":
    main()
