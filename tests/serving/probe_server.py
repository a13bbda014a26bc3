"""The hostile-request tests' server, in a process of its own: a tiny random Llama over the default model's real
tokenizer (49,152 tokens, real xgrammar), two named API keys, the fair policy, a Responses store, and the limits
issues 33 and 49 probe. Its resident memory is the server's alone: read in the pytest process, it also counted
whatever the suite's earlier tests left behind (a row past its 50 MB once there, 20 minutes into the suite, that
the file alone never showed). Unlike serve_process.py's CLI server, which is killed at the end, it stops when
asked, and then checks that no block or request was left behind.

    python tests/serving/probe_server.py STORE_DIR   # prints the base URL; serves until its stdin closes
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

STORE_MAX_COUNT = 48


@contextlib.contextmanager
def probe_server(store_dir: str):
    """Yields (base URL, pid). At exit its stdin closes: it must stop within a minute with every block free and
    no request left (conftest.assert_no_leak, checked in the child: a failure is its exit status)."""
    process = subprocess.Popen([sys.executable, __file__, store_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        url = next((line.strip() for line in process.stdout if line.startswith("http://")), None)
        assert url is not None, f"the probe server did not start (exit status {process.wait()})"
        yield url, process.pid
        process.stdin.close()
        assert process.wait(60) == 0, "the probe server did not stop cleanly (its stderr is above)"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def main(store_dir: str) -> None:
    sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # tests/: conftest, tiny_server
    from conftest import assert_no_leak, real_tokenizer, tiny_model_for
    from hostile_probe import KEYS
    from tiny_server import serving

    import paged_hf
    from paged_hf.serving.openai import ServerSettings, create_app

    tokenizer = real_tokenizer()
    model = tiny_model_for(tokenizer, 4096)
    generator = paged_hf.wrap(model, tokenizer, num_blocks=512, max_num_seqs=32, max_num_batched_tokens=256,
                              max_bad_words=256, grammar_compile_timeout_s=2.0, scheduling_policy="fair").generator
    settings = ServerSettings(api_key=[f"{name}={key}" for name, key in KEYS.items()],
                              trust_request_chat_template=True, escape_special_tokens=True,
                              chat_template_timeout_s=0.5, max_logprob_entries=100_000,
                              responses_store_dir=store_dir, responses_store_max_count=STORE_MAX_COUNT)
    with serving(create_app(generator, tokenizer, "tiny", settings)) as url:
        print(url, flush=True)
        sys.stdin.read()
    assert_no_leak(generator)


if __name__ == "__main__":
    main(sys.argv[1])
