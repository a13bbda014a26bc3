"""A tiny word-level tokenizer and a real uvicorn server in a thread: what the server tests share."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time

from conftest import VOCAB

API_KEY = "test-key"
MODEL = "tiny-llama"
WORDS = ("the a an of to in and is it you that he was for on are with as I his they be at one have this from or "
         "had by hot word but what some we can out other were all there when up use your how said each she which do "
         "their time if will way about many then them write would like so these her long make thing see him two has "
         "look more day could go come did number sound no most people my over know water than call first who may "
         "down side been now find any new work part take get place made live where after back little only round man "
         "year came show every good me give our under name very through just form sentence great think say").split()


def tiny_tokenizer():
    """A 128-token word-level tokenizer (the tiny model's vocab_size) with a one-line chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = ["<pad>", "<s>", "</s>", "<unk>", "<user>", "<assistant>", "<system>", *WORDS]
    vocab = {name: i for i, name in enumerate(names[:VOCAB])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>")
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    return tokenizer


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a port bind(0) hands out is free again once checked, and
    until the server binds it another process's bind(0) or outgoing connection can take it (torchrun's ranks open
    many: a served test once failed with "address already in use")."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            ephemeral_low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(max(1024, ephemeral_low - 10000), ephemeral_low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # every try taken: any free port
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(app):
    """A real uvicorn server for `app` on a free local port, in a thread; yields its base URL."""
    port = free_port()
    import uvicorn  # noqa: PLC0415 - the 'serve' extra

    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(20)
        assert not thread.is_alive()


class StreamedCalls:
    """Tool calls from streamed deltas as OpenAI clients join them: per `index`, the id and name of its first
    delta, the arguments of every delta concatenated."""

    def __init__(self):
        self.calls: dict[int, list] = {}

    def add(self, deltas) -> None:
        for delta in deltas or []:
            call = self.calls.setdefault(delta.index, [None, None, ""])
            if delta.id is not None:
                assert call[0] is None, f"call {delta.index} announced twice"
                call[0], call[1] = delta.id, delta.function.name
            call[2] += delta.function.arguments or ""

    def joined(self) -> list[tuple[str, str]]:
        """(name, arguments JSON text) per call, in index order."""
        return [(name, arguments) for _, name, arguments in (self.calls[i] for i in sorted(self.calls))]
