"""`paged-hf proxy`: the router of disaggregated prefill and decode (docs/disaggregated.md).

A client talks to the proxy as to one OpenAI server. A long prompt is first sent to a prefill instance (one
token, `kv_transfer_params: {"do_remote_decode": true}`), then to a decode instance with the transfer
parameters the prefill answered, so that decode reads the prompt's KV blocks instead of computing them.
"""

from paged_hf.serving.proxy.app import create_proxy_app
from paged_hf.serving.proxy.routing import ProxySettings

__all__ = ["ProxySettings", "create_proxy_app"]
