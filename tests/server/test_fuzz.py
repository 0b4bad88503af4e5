"""Any JSON body on any endpoint: never a 500, always 2xx or the peer's error object."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
KEYS = st.sampled_from(
    [
        "prompt",
        "messages",
        "n_predict",
        "max_tokens",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "seed",
        "stop",
        "stream",
        "cache_prompt",
        "return_tokens",
        "n_probs",
        "id_slot",
        "content",
        "tokens",
        "filename",
        "with_pieces",
        "add_special",
        "logprobs",
        "top_logprobs",
        "stream_options",
        "grammar",
        "n",
        "model",
        "input",
        "input_prefix",
        "input_suffix",
        "input_extra",
        "encoding_format",
        "embd_normalize",
    ]
)
BODIES = st.dictionaries(KEYS, JSON, max_size=6)
PATHS = st.sampled_from(
    [
        "/completion",
        "/v1/completions",
        "/v1/chat/completions",
        "/infill",
        "/embeddings",
        "/v1/embeddings",
        "/tokenize",
        "/detokenize",
        "/apply-template",
        "/slots/0?action=save",
        "/slots/0?action=restore",
        "/slots/0?action=erase",
        "/slots/x?action=save",
    ]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=PATHS, body=BODIES)
def test_no_500_on_any_body(make_api, slot_dir, path, body):
    client, _, _ = make_api(slot_save_path=str(slot_dir), fim=True, embedding=True, pooling="mean")
    route, _, query = path.partition("?")
    small = {**body, "n_predict": 2} if "n_predict" not in body and "max_tokens" not in body else body
    result = client.simulate_post(
        route, query_string=query, body=json.dumps(small), content_type="application/json"
    )
    assert result.status_code < 500 or result.status_code == 501, (path, small, result.text)
    if result.status_code >= 400:
        error = result.json["error"]
        assert error["code"] == result.status_code and isinstance(error["message"], str)
